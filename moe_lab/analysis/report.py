"""Writing an analysis task's outputs: CSV + Markdown tables, PNG figures, and W&B image logging."""

from __future__ import annotations

import csv
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..core.atomic import atomic_write


def write_csv(rows: list[dict], path) -> Path:
    """``rows`` as CSV (columns: the first row's keys), atomically."""
    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    return atomic_write(path, write)


def markdown_table(rows: list[dict], columns: dict[str, str], formats: dict[str, str] | None = None) -> str:
    """A Markdown table of ``rows`` with ``columns`` {key: header}, values formatted by ``formats`` {key: spec}."""
    formats = formats or {}

    def cell(row, key):
        value = row.get(key, "")
        return format(value, formats[key]) if key in formats and isinstance(value, (int, float)) else str(value)

    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, k) for k in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def save_figure(fig: Figure, path) -> Path:
    """Save through the Agg canvas (no pyplot state), atomically."""
    FigureCanvasAgg(fig)
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=fig.dpi, bbox_inches="tight"))


def log_images(cfg, images: dict[str, Path], summary: dict | None = None) -> bool:
    """Log PNGs (and a summary) to W&B when ``logger=wandb``; returns whether anything was logged."""
    wb = (cfg.get("logger") or {}).get("wandb") if cfg.get("logger") else None
    if not wb:
        return False
    import wandb

    if wandb.run is None:
        wandb.init(project=wb.get("project"), name=wb.get("name"), group=wb.get("group"),
                   dir=str(wb.get("save_dir")), mode="offline" if wb.get("offline") else None,
                   config={"task": cfg.task.name, "model": cfg.model.name})
    wandb.log({key: wandb.Image(str(path)) for key, path in images.items()})
    if summary:
        wandb.run.summary.update(summary)
    return True
