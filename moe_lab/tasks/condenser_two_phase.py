"""task=condenser_two_phase: Expert Condenser's two-phase protocol (the authors' public code) as one command.

``python run.py task=condenser_two_phase method=condenser_public_code [model=...] [dataset=...]`` runs the
finetune task twice, with configs derived from ``cfg`` (``method=condenser``: the paper's routing and update rule
in the same two phases):

* ``<run>/phase1``: biases only (``method.options.n=0``, no condensers) with ``task.phase1.gamma`` (public code
  1e-3) for ``task.phase1.max_steps`` (null: ``task.trainer.max_steps``) at ``task.phase1.lr`` (null:
  ``task.optim.lr``, the rebuttal configs train the weights; 0: the weights stay bit-identical, a bias-only
  phase). It writes ``phase1/condenser.json`` (the biases and the usage accumulated while they learned) and
  ``phase1/export``.
* ``<run>/phase2``: from phase 1's model (``task.phase2.init=phase1``, the rebuttal configs' "Starts from Phase-1
  model"; ``original``: the base model's weights), with ``bias_file=phase1/condenser.json``: the
  ``method.options.n`` condensers are fixed at once by ``method.options.select`` from those biases (ties by
  usage), then training runs with ``task.phase2.gamma`` (public code 5e-5). ``phase2/export`` is the result.

Both phases use ``task.trainer``, ``task.optim``, ``task.scheduler`` and ``task.batch_size`` (per device; the
rebuttal configs: 1 epoch, lr 1e-5, batch 4, cosine to 0.1 x lr, warm-up 0.1).
Resume: ``task.resume=<run>`` reuses a finished phase 1 and continues the phase that did not finish from its
``last.ckpt`` (:func:`moe_lab.runs.stage.run_stage`). ``task.phase1.bias_file=<a run>/phase1/condenser.json``
skips phase 1 (with ``init=phase1`` the model is the ``export`` beside it) and ``task.ckpt_path`` resumes phase 2.
``<run>/summary.json`` holds both phases' summaries.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, open_dict

from ..core.atomic import atomic_write_json
from ..methods.condenser import STATE_FILE
from ..runs.stage import run_stage
from ..runs.training import finetune

INITS = ("original", "phase1")


def _check(cfg: DictConfig) -> None:
    if cfg.method.get("method") != "condenser":
        raise ValueError(f"task=condenser_two_phase needs method=condenser, got method={cfg.method.get('method')}")
    if int(cfg.method.options.n) < 1:
        raise ValueError("task=condenser_two_phase: method.options.n=0 chooses no condensers; set n>=1 (or run "
                         "task=finetune method=condenser method.options.n=0 for biases only)")
    if cfg.task.phase2.init not in INITS:
        raise ValueError(f"task.phase2.init={cfg.task.phase2.init!r}: choose one of {', '.join(INITS)}")
    if cfg.task.ckpt_path and not cfg.task.phase1.bias_file:
        raise ValueError("task.ckpt_path resumes phase 2: also set task.phase1.bias_file=<run>/phase1/"
                         f"{STATE_FILE} so that phase 1 is not run again")
    if cfg.task.phase2.init == "phase1" and cfg.task.phase1.bias_file:
        export = Path(cfg.task.phase1.bias_file).parent / "export"
        if not (export / "config.json").is_file():
            raise ValueError(f"task.phase2.init=phase1 starts from phase 1's export, and {export} (beside "
                             f"task.phase1.bias_file) holds none: give the bias file of a phase-1 run that "
                             "exported, or set task.phase2.init=original")
    batch_size = cfg.task.get("batch_size")
    if batch_size is not None and (isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1):
        raise ValueError(f"task.batch_size={batch_size!r}: give an integer >= 1 (per device), or null for "
                         "dataset.batch_size")


def _finish_wandb() -> None:
    import wandb

    if wandb.run is not None:
        wandb.finish()


def condenser_two_phase(cfg: DictConfig) -> dict:
    """Phase 1 (biases) then phase 2 (condensers fixed from phase 1's biases); see the module docstring."""
    _check(cfg)
    if cfg.task.get("batch_size") is not None:
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            cfg.dataset.batch_size = int(cfg.task.batch_size)
    out = Path(cfg.paths.output_dir)
    p1, p2 = cfg.task.phase1, cfg.task.phase2
    summary: dict = {}
    bias_file = p1.bias_file
    if bias_file is None:
        summary["phase1"] = run_stage(cfg, "phase1", finetune, **{
            "method.options.gamma": p1.gamma, "method.options.n": 0, "method.options.bias_file": None,
            "method.options.experts": None,
            "task.trainer.max_steps": p1.max_steps if p1.max_steps is not None else cfg.task.trainer.max_steps,
            "task.export": bool(p1.export) or p2.init == "phase1", "task.ckpt_path": None,
            "task.optim.lr": p1.lr if p1.lr is not None else cfg.task.optim.lr})
        _finish_wandb()
        bias_file = out / "phase1" / STATE_FILE
    model = {"model.pretrained": str(Path(bias_file).parent / "export")} if p2.init == "phase1" else {}
    result = run_stage(cfg, "phase2", finetune, **{
        "method.options.gamma": p2.gamma, "method.options.bias_file": str(bias_file), "method.options.experts": None,
        **model})
    summary.update(result)
    summary["bias_file"] = str(bias_file)
    if rank_zero_only.rank == 0:
        condensers = json.loads((out / "phase2" / STATE_FILE).read_text())["layers"]
        summary["condensers"] = {i: layer["forced_experts"] for i, layer in condensers.items()}
        atomic_write_json(out / "summary.json", summary, indent=2)
    return summary
