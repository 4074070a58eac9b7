"""task=d2d_prune: the MoE -> dense paper's dense-to-dense baseline (App. M, Table 13). Minitron-style importance
on the calibration batches, every ``task.candidates`` architecture pruned from it and scored by perplexity on
``compress.eval``, the lowest exported (``moe_lab.compress.d2d``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from omegaconf import DictConfig

from ..compress.d2d import D2DTarget, best_candidate, prune_candidates, prune_dense
from ..compress.dense import export_compressed
from ..compress.diagnostics import write_table
from ..core.atomic import atomic_write_json, atomic_write_text
from ..core.plain import to_plain
from ..models import load_model
from ..runs.calibrate import calibration_sequences
from ..runs.compress import student_ppl
from ..runs.compress_sweep import format_ppl


def _targets(t) -> dict[str, D2DTarget]:
    candidates = to_plain(t.get("candidates")) or {}
    if not candidates:
        raise ValueError("task.candidates is empty: give {name: {num_hidden_layers, hidden_size, intermediate_size, "
                         "num_attention_heads, num_key_value_heads}}")
    try:
        return {name: D2DTarget(**{k: int(v) for k, v in sizes.items()}) for name, sizes in candidates.items()}
    except TypeError as err:
        raise ValueError(f"task.candidates: {err}; each candidate needs exactly num_hidden_layers, hidden_size, "
                         "intermediate_size, num_attention_heads, num_key_value_heads") from err


def d2d_prune_task(cfg: DictConfig) -> dict:
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    targets = _targets(cfg.task)
    model, tokenizer = load_model(cfg.model, dense=True)  # a dense model (as a KD teacher or student)
    model.eval()
    batches, source = calibration_sequences(cfg.compress.calibration.dataset, tokenizer, cfg.compress.calibration)
    rows, plans = prune_candidates(model, batches, targets,
                                   lambda student: student_ppl(student, tokenizer, cfg.compress))
    best = best_candidate(rows)
    frame = pd.DataFrame(rows)
    write_table(frame, out / "candidates.csv")
    lines = ["| candidate | layers | d | d_dense | heads | KV heads | params | pre-distill PPL |", "|---" * 8 + "|"]
    for r in rows:
        mark = "**" if r is best else ""
        lines.append(f"| {mark}{r['candidate']}{mark} | {r['num_hidden_layers']} | {r['hidden_size']} | "
                     f"{r['intermediate_size']} | {r['num_attention_heads']} | {r['num_key_value_heads']} | "
                     f"{r['params'] / 1e9:.2f}B | {format_ppl(r['ppl'])} |")
    atomic_write_text(out / "candidates.md", "\n".join(lines) + "\n")
    summary = {"teacher": cfg.model.name, "calibration": source, "candidates": rows, "chosen": best["candidate"],
               "teacher_params": sum(p.numel() for p in model.parameters())}
    if cfg.task.export:
        student = prune_dense(model, plans[best["candidate"]], targets[best["candidate"]])
        summary["export"] = str(export_compressed(student, out / "export", tokenizer))
    atomic_write_json(out / "summary.json", summary, indent=2, default=str)
    print(f"==== moe-lab d2d_prune: chose {best['candidate']} (ppl {best['ppl']:.4g}) of {len(rows)} candidates",
          flush=True)
    return summary
