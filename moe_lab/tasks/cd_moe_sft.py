"""task=cd_moe_sft: the CD-MoE "+ SFT" rows (compression spec 3.8, 3.9) in one run.

Stages, each the existing task on a copy of the config: ``calibrate/`` (task=calibrate on the search data,
skipped with ``condense.calibration_file``), ``condense/`` (task=condense, condensed export), optionally
``lm/`` ([CD-code] recipe: one language-modelling epoch on ``cd_sft.lm_stage.dataset`` with method=condense_sft),
then the task SFT (task=finetune, method=condense_sft) in the run directory itself (``metrics.csv``,
``checkpoints/``, ``export/``), then lm-eval on the reloaded export (``condense.eval``). ``cd_sft.condensed``
starts from an existing task=condense export instead of the first two stages; ``task.resume=<run>`` reuses the
finished stages of that run and resumes its SFT from ``checkpoints/last.ckpt``. ``summary.json`` holds the
results table that ``python -m experiments.collect condense <run>`` compares with the paper.
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from ..core.atomic import atomic_write_json
from ..core.plain import to_plain
from ..eval.lm_eval_table import results_table, task_source
from ..runs.calibrate import calibrate_task
from ..runs.condense import condense_task
from ..runs.stage import run_stage, stage_config
from ..runs.training import finetune

STAGE_KEYS = ("train/loss", "global_step", "resumed_from_step", "wall_time_s", "export")


def _check(cfg: DictConfig) -> None:
    if not str(cfg.method.get("_target_", "")).endswith("CondenseSFTModule"):
        raise ValueError(f"task=cd_moe_sft trains with method=condense_sft, got method={cfg.method.name}: add "
                         "method=condense_sft (or use a preset: experiment=condense/deepseek_moe_sr_sft)")
    if cfg.condense.method != "cd_moe":
        raise ValueError(f"task=cd_moe_sft condenses (condense.method=cd_moe), got condense.method="
                         f"{cfg.condense.method}: LayerTrim/BlockTrim leave no experts to fine-tune")
    if cfg.cd_sft.condensed and not (Path(cfg.cd_sft.condensed) / "condense_manifest.json").is_file():
        raise FileNotFoundError(f"cd_sft.condensed={cfg.cd_sft.condensed} has no condense_manifest.json: pass a "
                                "task=condense export directory (<run>/export) or null to condense here")


def recipe_method(cfg: DictConfig) -> dict:
    """The method settings ``cd_sft_recipe`` fixes for both SFT stages (code: every token in the loss, no fp32
    master weights), as dotted updates; {} where the recipe leaves the method's own."""
    keys = {"loss_tokens": "method.options.loss_tokens", "master_weights": "method.master_weights"}
    return {dotted: cfg.cd_sft.get(key) for key, dotted in keys.items() if cfg.cd_sft.get(key) is not None}


def recipe_line(cfg: DictConfig) -> str:
    """One line on what the recipe runs: its name, and for [CD-code]'s what the public code does differently."""
    recipe = cfg.cd_sft.get("recipe") or "paper"
    if recipe != "code":
        return f"cd_sft_recipe={recipe}: lr {cfg.task.optim.lr}, {cfg.task.scheduler.name} schedule"
    method = recipe_method(cfg)
    lm = cfg.cd_sft.get("lm_stage")
    return (f"cd_sft_recipe=code: the public code's recipe as it runs, no hand-added overrides: loss on "
            f"{method.get('method.options.loss_tokens', cfg.method.options.loss_tokens)} tokens (prompt and padding "
            f"included), master weights {method.get('method.master_weights', cfg.method.master_weights)} (no fp32 "
            f"copy), lr {cfg.task.optim.lr} {cfg.task.scheduler.name}"
            + (f", one LM epoch on {lm.dataset.path} first" if lm else ""))


def _condense(cfg: DictConfig, out: Path) -> tuple[str, dict]:
    """(condensed export directory, condense-stage summary): calibrate on the search data, then condense."""
    c = cfg.condense
    calibration = c.calibration_file
    if not calibration:
        s = c.search
        gate_pass = c.get("gate_pass", "search")
        if gate_pass not in ("search", "untruncated"):
            raise ValueError(f"condense.gate_pass={gate_pass!r}: choose search (the search rows) or untruncated "
                             "(the search documents whole, batch 1, as [CD-code])")
        if gate_pass == "untruncated" and s.sample != "documents":
            raise ValueError("condense.gate_pass=untruncated takes the search documents whole: it needs "
                             "condense.search.sample=documents")
        whole = gate_pass == "untruncated"
        calibration = run_stage(cfg, "calibrate", calibrate_task, **{
            "compress.calibration.dataset": to_plain(s.dataset), "compress.calibration.num_sequences": s.num_sequences,
            "compress.calibration.seq_len": None if whole else s.seq_len, "compress.calibration.sample": s.sample,
            "compress.calibration.pool_blocks": s.pool_blocks, "compress.calibration.seed": s.seed,
            "compress.calibration.batch_size": 1 if whole else s.batch_size})["calibration"]
    tasks = list(c.eval.tasks) if cfg.cd_sft.eval_condensed else []
    summary = run_stage(cfg, "condense", condense_task, **{
        "condense.calibration_file": str(calibration), "condense.export": "condensed", "condense.eval.tasks": tasks})
    return summary["export"], _condensed_summary(summary)


def _condensed_summary(summary: dict) -> dict:
    return {k: summary.get(k) for k in ("layers", "experts", "memory_ratio", "params_after", "params_before",
                                        "export", "eval")}


def _evaluate(cfg: DictConfig, export: Path, label: str) -> dict:
    import gc

    import torch

    from ..compress.condense import load_condensed
    from ..data.tokenizer import load_tokenizer
    from ..eval.lm_eval_bridge import evaluate_with_lm_eval, lm_eval_metrics

    e = cfg.condense.eval
    gc.collect()  # the training stage's trainer/module cycles: free their device memory first
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    model = load_condensed(export, device="cuda" if torch.cuda.is_available() else "cpu").eval()
    has_tokenizer = any((export / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = load_tokenizer(str(export) if has_tokenizer else cfg.model.tokenizer or cfg.model.pretrained)
    result = evaluate_with_lm_eval(model, tokenizer, list(e.tasks), limit=e.limit, batch_size=int(e.batch_size),
                                   hub_tasks=bool(e.hub_tasks), data_dir=cfg.paths.data_dir)
    metrics = lm_eval_metrics(result)
    table = results_table(metrics, list(e.tasks), cfg.model.name, label)
    return {"eval": metrics, "table": table.to_json(), "columns": table.columns, "limit": e.limit,
            "eval_settings": {"task_source": task_source(list(e.tasks))}}


def cd_moe_sft(cfg: DictConfig) -> dict:
    """Condense, fine-tune the retained experts, evaluate; writes ``summary.json`` in the run directory."""
    _check(cfg)
    out = Path(cfg.paths.output_dir)
    start = time.time()
    label = "cd_moe_s" if int(cfg.condense.routed_experts) == 0 else "cd_moe_sr"
    summary: dict = {"model": cfg.model.name, "method": label, "recipe": to_plain(cfg.cd_sft)}
    print(f"==== moe-lab cd_moe_sft: {recipe_line(cfg)}", flush=True)
    method = recipe_method(cfg)
    # task.resume=<this run>: finished stages are reused (run_stage), the SFT resumes from its last.ckpt
    if cfg.cd_sft.condensed:
        export = str(cfg.cd_sft.condensed)
    else:
        export, summary["condense"] = _condense(cfg, out)
    lm = cfg.cd_sft.get("lm_stage")
    if lm:
        lm_run = run_stage(cfg, "lm", finetune, dataset=to_plain(lm.dataset), **{
            **method, "method.options.condensed": export, "task.ckpt_path": None})
        summary["lm_stage"] = {k: lm_run.get(k) for k in STAGE_KEYS}
        export = lm_run["export"]
    updates = {**method, "method.options.condensed": export}
    if not (out / "checkpoints" / "last.ckpt").exists():  # a resumed run that stopped before its SFT began
        updates["task.resume"] = None
    sft = finetune(stage_config(cfg, out, **updates))
    summary["sft"] = {k: sft.get(k) for k in STAGE_KEYS}
    if sft.get("export") and list(cfg.condense.eval.tasks):
        summary.update(_evaluate(cfg, Path(sft["export"]), label))
        summary["checkpoint"] = sft["export"]  # experiments.collect: the training run is this run directory
        values = [c["value"] for c in summary["table"]]
        print(f"==== moe-lab cd_moe_sft ({label}): mean of {len(values)} lm-eval tasks "
              f"{sum(values) / max(len(values), 1):.2f}", flush=True)
    summary["wall_time_s"] = round(time.time() - start, 1)
    atomic_write_json(out / "summary.json", summary, indent=2, default=str)
    return summary
