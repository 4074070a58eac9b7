"""ESFT-Gate / ESFT-Token as a LightningModule: the expert selection is made at fit start.

The selection comes from (first match wins): ``options.experts`` (explicit ids), ``selection_file`` (the
``experts`` of a JSON written by a previous run or the public ESFT ``expert_cfg.json``), ``scores_file``
(re-select from saved scores with this run's ``score``/``p``/``normalize``), or a routing-statistics pass
over the first ``score_batches`` batches of the train loader at fit start (all-reduced across ranks).
Scores and selection are written to ``<run dir>/esft_selection.json`` and stored in checkpoints; a resumed
run must arrive at the same selection.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..core.plain import to_plain
from .base import MoELightningModule
from .esft import (
    AVERAGES,
    SCORES,
    esft_select,
    esft_statistics,
    load_selection,
    normalize_selection,
    save_selection,
    select_experts,
    slice_optimizer,
)

log = logging.getLogger(__name__)

ARTIFACT = "esft_selection.json"
CHECKPOINT_KEY = "moe_lab_esft"


def _flattens_parameters(strategy) -> bool:
    """FSDP and DeepSpeed step parameters as flat shards (no per-expert slices for the optimizer to step)."""
    from ..runtime.strategies import strategy_kind

    return strategy_kind(strategy).startswith(("fsdp", "deepspeed"))


def partitioned(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are already shards (ZeRO-3 partitions, FSDP flat parameters): Lightning
    calls ``setup`` before the strategy wraps the model, so the selection is scored on whole weights there."""
    return any(hasattr(p, "ds_id") or type(p).__name__ in ("FlatParameter", "DTensor") for p in model.parameters())


class ESFTLightningModule(MoELightningModule):
    """ESFT fine-tuning. ``score``: "token" (ESFT-Token) or "gate" (ESFT-Gate); ``p``: cumulative-score
    threshold; ``score_batches``: train batches scored at fit start; ``average``/``normalize``: see
    :func:`~moe_lab.methods.esft.esft_scores` / :func:`~moe_lab.methods.esft.esft_select`. ``options``
    are :func:`~moe_lab.methods.esft.install_esft`'s (``train_*`` flags, optional ``experts``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        score: str = "token",
        p: float = 0.2,
        score_batches: int = 16,
        selection_file: str | None = None,
        scores_file: str | None = None,
        normalize: bool = False,
        average: str = "sequence",
        method: str = "esft",
        options: dict | None = None,
        **kwargs,
    ):
        if method != "esft":
            raise ValueError(f"ESFTLightningModule runs method 'esft', got method={method!r}")
        if score not in SCORES:
            raise ValueError(f"method.score={score!r} is not one of {SCORES}")
        if average not in AVERAGES:
            raise ValueError(f"method.average={average!r} is not one of {AVERAGES}")
        if not p > 0:
            raise ValueError(f"method.p={p!r} must be > 0")
        if int(score_batches) < 1:
            raise ValueError(f"method.score_batches={score_batches!r} must be >= 1")
        options = dict(to_plain(options) or {})
        explicit = options.pop("experts", None)
        sources = [name for name, v in (("options.experts", explicit), ("selection_file", selection_file),
                                        ("scores_file", scores_file)) if v is not None]
        if len(sources) > 1:
            raise ValueError(f"ESFT selection given twice ({' and '.join(sources)}): keep one")
        self.esft_config = {"score": score, "p": float(p), "score_batches": int(score_batches),
                            "normalize": bool(normalize), "average": average,
                            "selection_file": selection_file, "scores_file": scores_file}
        self.esft_scores: dict | None = None
        self.esft_info: dict = {}
        self.selection: dict[int, list[int]] | None = None
        selection, source = None, None
        if explicit is not None:
            selection, source = normalize_selection(explicit), "options.experts"
        elif selection_file is not None:
            loaded = load_selection(selection_file)
            if "experts" not in loaded:
                raise ValueError(f"selection_file={selection_file!r} has scores but no 'experts': pass it as "
                                 "scores_file to select from its scores")
            self.esft_scores = loaded.get("scores")
            selection, source = loaded["experts"], f"selection_file={selection_file}"
        elif scores_file is not None:
            loaded = load_selection(scores_file)
            if "scores" not in loaded:
                raise ValueError(f"scores_file={scores_file!r} has no 'scores'")
            self.esft_scores = loaded["scores"]
            selection, source = self._select(self.esft_scores), f"scores_file={scores_file}"
        elif kwargs.get("lora"):
            raise ValueError("ESFT with lora needs its selection before the adapters are attached: pass "
                             "method.selection_file=, method.scores_file= or method.options.experts= (e.g. the "
                             "esft_selection.json of a run without lora)")
        # a known selection is installed with the method (before any adapters); otherwise at fit start
        super().__init__(model, method="esft", options={**options, "experts": selection or {}}, **kwargs)
        self.hparams["esft"] = dict(self.esft_config)
        if selection is not None:
            self._record(normalize_selection(selection), source)

    # selection ----------------------------------------------------------------------------------
    def _select(self, scores) -> dict[int, list[int]]:
        c = self.esft_config
        return esft_select(scores, c["p"], score=c["score"], normalize=c["normalize"])

    def _install(self, selection: dict[int, list[int]], source: str) -> None:
        self._record(select_experts(self.patch, selection), source)

    def _record(self, selection: dict[int, list[int]], source: str) -> None:
        self.selection = selection
        self.esft_info["source"] = source
        self.hparams["options"]["experts"] = {int(k): list(v) for k, v in self.selection.items()}
        total = sum(len(v) for v in self.selection.values())
        log.info("ESFT: training %d routed experts over %d MoE layers (%s)", total, len(self.selection), source)

    def setup(self, stage: str) -> None:
        if stage != "fit":
            return
        if self.selection is None:
            self.esft_scores = self._score_training_data()
            self._install(self._select(self.esft_scores), source=f"{self.esft_config['score_batches']} train batches")
        directory = Path(self.trainer.log_dir or self.trainer.default_root_dir)  # a collective: all ranks
        if self.trainer.is_global_zero:
            self._write_artifact(directory)

    def _score_training_data(self) -> dict:
        trainer = self.trainer
        strategy = trainer.strategy
        if partitioned(self.model):
            raise ValueError(f"ESFT cannot score the training data under {type(strategy).__name__}: the model's "
                             "parameters are already sharded. Compute the selection first (moe_lab.esft_scores / "
                             "a single-device run) and pass method.selection_file=<esft_selection.json>")
        loader = trainer.datamodule.train_dataloader() if trainer.datamodule is not None else \
            trainer.fit_loop._data_source.dataloader()
        self.model.to(strategy.root_device)
        with strategy.precision_plugin.forward_context():
            stats = esft_statistics(self.model, loader, max_batches=self.esft_config["score_batches"])
        if trainer.world_size > 1:
            stats.unpack(strategy.reduce(stats.packed().to(strategy.root_device), reduce_op="sum"))
        self.esft_info.update({"sequences": stats.sequences, "tokens": stats.tokens})
        return stats.scores(self.esft_config["average"])

    def _write_artifact(self, directory: Path) -> None:
        path = save_selection(directory / ARTIFACT, self.selection, self.esft_scores, method="esft",
                              **{k: v for k, v in self.esft_config.items() if v is not None}, **self.esft_info)
        self.esft_info["artifact"] = str(path)

    def configure_optimizers(self):
        """The base module's optimizer, stepping only the trained expert slices (:func:`slice_optimizer`)
        where the strategy keeps whole parameters (not FSDP / DeepSpeed, which flatten them, nor expert
        parallelism, whose optimizer state gathers whole local expert tensors)."""
        config = super().configure_optimizers()
        flattened = self._trainer is not None and _flattens_parameters(self.trainer.strategy)
        expert_parallel = getattr(self.patch, "expert_parallel", None) is not None
        sliced = not (flattened or expert_parallel) and slice_optimizer(config["optimizer"], self.patch) > 0
        self.optimizer_layout = "sliced" if sliced else "packed"
        resumed = getattr(self, "_resumed_optimizer_layout", None)
        if resumed is not None and resumed != self.optimizer_layout:
            raise ValueError(
                f"this ESFT checkpoint holds optimizer state for {resumed} expert tensors, but this run steps "
                f"{self.optimizer_layout} ones (FSDP, DeepSpeed, hardware.ep_size > 1 and checkpoints written before "
                "moe-lab stepped only the trained expert slices hold whole packed tensors): its optimizer state "
                "cannot be restored. Resume under the moe-lab version, strategy and hardware.ep_size (> 1 or 1) that "
                "wrote it, or start a new run from its weights "
                "(model.pretrained=<run>/export method.selection_file=<run>/esft_selection.json)")
        return config

    # checkpoints --------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[CHECKPOINT_KEY] = {
            "experts": {int(k): list(v) for k, v in (self.selection or {}).items()},
            "config": dict(self.esft_config),
            "optimizer_layout": getattr(self, "optimizer_layout", "packed"),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        stored = checkpoint.get(CHECKPOINT_KEY)
        if stored is None:
            raise ValueError("this checkpoint was not written by an ESFT run (no ESFT selection in it)")
        if checkpoint.get("optimizer_states"):  # checked against this run's layout in configure_optimizers
            self._resumed_optimizer_layout = stored.get("optimizer_layout", "packed")
        stored_selection = normalize_selection(stored["experts"])
        if self.selection is None:
            self._install(stored_selection, source="checkpoint")
        elif stored_selection != self.selection:
            raise ValueError(
                "the ESFT selection of this run differs from the one in the checkpoint being resumed: pass "
                "method.selection_file=<the original run's esft_selection.json> to resume with its selection")
