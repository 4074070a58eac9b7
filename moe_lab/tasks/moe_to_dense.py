"""task=moe_to_dense: calibrate -> convert -> distil (method=kd, the unmodified MoE as teacher) -> perplexity.

Each stage is the existing task run in its own sub-directory of the run directory: ``calibrate/``
(task=calibrate, skipped with ``compress.calibration_file``), ``convert/`` (task=compress, single point,
export on), ``distill/`` (task=finetune with the exported student as ``model`` and the original ``model`` as
``method.teacher``). ``compress.init`` = random_ffn | random replaces the converted student by the paper's
baselines before distillation. ``summary.json`` ``pre_distill``: the perplexity of the student distillation starts
from (``student``: converted | random_ffn | random); for a baseline, ``pre_distill.converted`` holds the converted
student's. ``task.resume=<run dir>`` reuses the stages that finished and continues the one that did not (the
distillation from ``distill/checkpoints/last.ckpt``; :func:`moe_lab.runs.stage.run_stage`).
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from ..compress.dense import export_compressed
from ..core.atomic import atomic_write_json
from ..core.plain import to_plain
from ..models import load_model
from ..moe.view import find_moe_layers
from ..runs.calibrate import calibrate_task
from ..runs.compress import compress, student_ppl
from ..runs.stage import run_stage
from ..runs.training import finetune

log = logging.getLogger(__name__)

INITS = ("converted", "random_ffn", "random")
ROLLING = 10  # steps in the KD plot's rolling mean


def ffn_names(teacher, num_layers: int) -> list[str]:
    """The FFN module name of every decoder layer (the MoE blocks' names, for every layer index)."""
    name = find_moe_layers(teacher)[0].name
    return [re.sub(r"layers\.\d+\.", f"layers.{i}.", name, count=1) for i in range(num_layers)]


@torch.no_grad()
def reinitialise(student, names: list[str], init: str, seed: int) -> None:
    """The paper's baselines: ``random_ffn`` re-draws the FFNs (``names``), ``random`` every module, with the
    dense class's ``_init_weights`` (normal(0, initializer_range) for linear layers)."""
    torch.manual_seed(seed)
    modules = list(student.modules()) if init == "random" else [
        m for n in names for m in student.get_submodule(n).modules()]
    for module in modules:  # from_pretrained marks modules AND tensors as initialised: init.* would skip them
        for item in (module, *module.parameters(recurse=False), *module.buffers(recurse=False)):
            if getattr(item, "_is_hf_initialized", False):
                item._is_hf_initialized = False
        student._init_weights(module)


def baseline_student(cfg: DictConfig, converted: Path, out: Path) -> tuple[Path, dict]:
    """``compress.init`` = random_ffn | random: the converted student (export ``converted``) re-initialised
    (:func:`reinitialise`, seed ``cfg.seed``) and exported to ``out``; returns the export and its perplexity
    (``student_ppl``), the baseline's pre-distillation starting point."""
    teacher_cfg = to_plain(cfg.model)
    teacher, tokenizer = load_model(teacher_cfg)
    student, _ = load_model({"pretrained": str(converted), "tokenizer": teacher_cfg.get("tokenizer"),
                             "dtype": teacher_cfg.get("dtype")}, dense=True)  # the to_dense export
    names = ffn_names(teacher, student.config.num_hidden_layers)
    del teacher
    reinitialise(student, names, cfg.compress.init, int(cfg.seed))
    student.moe_lab_manifest = {**json.loads((converted / "compress_manifest.json").read_text()),
                                "init": cfg.compress.init}
    path = export_compressed(student, out, tokenizer)
    return path, student_ppl(student, tokenizer, cfg.compress)


def _check(cfg: DictConfig) -> None:
    if not str(cfg.method.get("_target_", "")).endswith("KDModule"):
        raise ValueError(f"task=moe_to_dense distils with method=kd, got method={cfg.method.name}: add method=kd")
    if cfg.compress.method != "to_dense" or cfg.compress.sweep:
        raise ValueError("task=moe_to_dense converts one student: compress.method=to_dense, compress.sweep=false")
    if cfg.compress.init not in INITS:
        raise ValueError(f"compress.init={cfg.compress.init!r}: choose one of {', '.join(INITS)}")


def moe_to_dense(cfg: DictConfig) -> dict:
    """Run the four stages; writes summary.json and plots/kd_kl.png in the run directory."""
    _check(cfg)
    out = Path(cfg.paths.output_dir)
    start = time.time()
    summary: dict = {"model": cfg.model.name, "init": cfg.compress.init}
    calibration = cfg.compress.calibration_file
    if not calibration:
        calibration = run_stage(cfg, "calibrate", calibrate_task)["calibration"]
    summary["calibration"] = str(calibration)
    converted = run_stage(cfg, "convert", compress, **{"compress.calibration_file": str(calibration),
                                                       "compress.export": True})
    student_dir = Path(converted["export"])
    summary["pre_distill"] = {"student": "converted", "ppl": converted["ppl"], "status": converted["status"]}
    if "scaling_choice" in converted:  # compress.scaling=best_ppl: the Stage-2 choice and every candidate's ppl
        summary["scaling_choice"] = converted["scaling_choice"]
    teacher_cfg = to_plain(cfg.model)
    if cfg.compress.init != "converted":  # the baseline's own starting point; the converted one for reference
        student_dir, point = baseline_student(cfg, student_dir, out / "convert" / f"export_{cfg.compress.init}")
        summary["pre_distill"] = {"student": cfg.compress.init, "ppl": point["ppl"], "status": point["status"],
                                  "converted": summary["pre_distill"]}
    student_cfg = {**teacher_cfg, "name": f"{cfg.model.name}_dense", "pretrained": str(student_dir),
                   "config_class": None, "config": None}
    # the stage's config.yaml (run_stage writes it): task=evaluate reads the method there (kd: a dense export loads)
    distilled = run_stage(cfg, "distill", finetune, model=student_cfg, **{"method.teacher": teacher_cfg})
    summary["distill"] = {k: distilled.get(k) for k in ("global_step", "train/loss", "kd/kl", "kd/top1_agreement",
                                                         "wall_time_s", "export")}
    options = to_plain(cfg.method.get("options")) or {}
    if options.get("loss") == "fkl_hidden":  # the hidden-state term's normalisation and its last effective weight
        summary["distill"].update({"hidden_norm": options.get("hidden_norm", "balanced"),
                                   "hidden_weight": options.get("hidden_weight", 1.0),
                                   "kd/hidden_mse": distilled.get("kd/hidden_mse"),
                                   "kd/hidden_weight": distilled.get("kd/hidden_weight")})
    if distilled.get("export"):
        model, tokenizer = load_model({**student_cfg, "pretrained": distilled["export"]}, dense=True)
        point = student_ppl(model, tokenizer, cfg.compress)
        summary["post_distill"] = {"ppl": point["ppl"], "status": point["status"]}
    summary["plots"] = _plot_kl(out / "distill" / "metrics.csv", out / "plots" / "kd_kl.png")
    summary["wall_time_s"] = round(time.time() - start, 1)
    atomic_write_json(out / "summary.json", summary, indent=2, default=str)
    pre, post = summary["pre_distill"]["ppl"], summary.get("post_distill", {}).get("ppl")
    print(f"==== moe-lab moe_to_dense: ppl {pre:.4g} ({summary['pre_distill']['student']}) -> {post} (distilled); "
          f"KL plot {summary['plots']}", flush=True)
    return summary


def kl_curves(metrics: Path, window: int = ROLLING) -> dict[str, tuple[list[int], list[float]]]:
    """The KD plot's lines ``{label: (steps, values)}`` from a Lightning metrics.csv: ``kd/kl`` per step, its
    rolling mean over the last ``window`` logged steps (fewer at the start), and ``val/kd/kl`` where logged."""
    import pandas as pd

    from ..analysis.plots import read_metric_csv

    curves = {}
    train = sorted(read_metric_csv(metrics, "kd/kl"))
    if train:
        steps, values = map(list, zip(*train))
        curves["kd/kl"] = (steps, values)
        curves[f"kd/kl, rolling mean of {window} steps"] = (
            steps, pd.Series(values).rolling(window, min_periods=1).mean().tolist())
    val = sorted(read_metric_csv(metrics, "val/kd/kl"))
    if val:
        curves["val/kd/kl"] = tuple(map(list, zip(*val)))
    return curves


def plot_kl(metrics: Path, png: Path, window: int = ROLLING) -> Path:
    """``plots/kd_kl.png``: the :func:`kl_curves` of ``metrics`` (raw per-step KL thin, its rolling mean bold);
    raises ``ValueError`` when no KL was logged."""
    from matplotlib.figure import Figure

    from ..analysis.plots import _save

    curves = kl_curves(metrics, window)
    if not curves:
        raise ValueError(f"no kd/kl or val/kd/kl values in {metrics}")
    fig = Figure(figsize=(7.0, 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    styles = {"kd/kl": {"linewidth": 0.8, "alpha": 0.45, "color": "tab:blue"},
              "val/kd/kl": {"linewidth": 1.2, "marker": "o", "color": "tab:orange"}}
    for label, (steps, values) in curves.items():
        ax.plot(steps, values, label=label, **styles.get(label, {"linewidth": 2.0, "color": "tab:blue"}))
    ax.set_xlabel("step")
    ax.set_ylabel("KL(teacher || student), nats / token")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("student-teacher KL (forward, tau = 1)")
    return _save(fig, png)


def _plot_kl(metrics: Path, png: Path) -> str | None:
    if not metrics.exists():
        return None
    try:
        return str(plot_kl(metrics, png))
    except ValueError as err:
        log.warning("plots/kd_kl.png skipped: %s", err)
        return None
