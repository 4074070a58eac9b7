"""Routing drift: how far training has moved each MoE layer's routing of a fixed probe batch."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from moe_lab.analysis.drift_stats import DRIFT_STATS, RoutingSnapshot, drift_means, drift_sums, snapshot
from moe_lab.data.packing import is_packed, model_inputs, real_token_mask
from moe_lab.moe.block import split_router_output
from moe_lab.runtime.strategies import model_forward

from ._dense import without_moe_layers
from ._logging import ends_training, log_metrics, logging_step

log = logging.getLogger("moe_lab.callbacks")


def _patch_and_model(pl_module: pl.LightningModule):
    patch, model = getattr(pl_module, "patch", None), getattr(pl_module, "model", None)
    if patch is None or model is None:
        raise AttributeError(
            "RoutingDriftCallback needs the LightningModule to expose the MoEPatch as `self.patch` and the "
            "HF model as `self.model`"
        )
    return patch, model


def _first_loader(loaders):
    """The first dataloader of what ``trainer.val_dataloaders`` returns (a loader, list or dict), or None."""
    if loaders is None:
        return None
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


def _validation_loader(trainer: pl.Trainer):
    """The first validation dataloader of this fit (set up now if the sanity check did not), or None."""
    if not trainer.enable_validation:
        return None
    loader = _first_loader(trainer.val_dataloaders)
    if loader is None:  # no sanity check ran: set up what the fit loop sets up before validating
        trainer.fit_loop.epoch_loop.val_loop.setup_data()
        loader = _first_loader(trainer.val_dataloaders)
    return loader


def _batch_tensors(batch) -> dict[str, torch.Tensor]:
    """The tensors of a dict batch with ``input_ids``; anything else is refused with the expected format."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(
            "RoutingDriftCallback needs dict batches with `input_ids` (and `attention_mask`, or packed "
            f"`position_ids`/`token_mask`); got {type(batch).__name__}"
        )
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


def _probe_batch(batch) -> dict[str, torch.Tensor]:
    """A CPU copy of a batch's tensors, kept as the probe (and in the checkpoint)."""
    return {k: v.detach().cpu().clone() for k, v in _batch_tensors(batch).items()}


def _forward_inputs(batch: dict) -> tuple[dict, torch.Tensor | None]:
    """Model keyword arguments (no labels, no cache) and the real-token mask of a padded or packed batch."""
    if not is_packed(batch) and "attention_mask" not in batch:
        return {"input_ids": batch["input_ids"], "use_cache": False}, None
    inputs = model_inputs({**batch, "labels": None})
    inputs.pop("labels")
    return {**inputs, "use_cache": False}, real_token_mask(batch)


def capture_routing(pl_module: pl.LightningModule, batches, forward_context=None, forward=None
                    ) -> list[RoutingSnapshot]:
    """Route ``batches`` through ``pl_module.model`` (called as ``forward``, default the model itself; under
    FSDP the root wrapper, :func:`moe_lab.runtime.strategies.model_forward`) in eval mode without gradients and
    return one :class:`RoutingSnapshot` per MoE layer (real tokens of all batches, in order).

    Every module's training flag is restored afterwards. In eval mode the moe-lab blocks count no routing
    statistics (unless a ``patch.calibration()`` context is open, which this refuses), and methods that
    update state during training (e.g. router biases, after optimizer steps) are not triggered.
    """
    patch, model = _patch_and_model(pl_module)
    if patch.context.calibrating:
        raise RuntimeError("RoutingDriftCallback would count its probe: close patch.calibration() first")
    batches = [_batch_tensors(batch) for batch in batches]
    per_layer: list[list[RoutingSnapshot]] = [[] for _ in patch.layers]
    mask_box: list[torch.Tensor | None] = [None]

    def hook_for(position: int, rule, spec):
        def hook(module, args, output):
            logits, weights, indices = split_router_output(spec, output)
            per_layer[position].append(snapshot(rule, logits, weights, indices, mask_box[0]))

        return hook

    flags = [(m, m.training) for m in model.modules()]
    handles = [
        getattr(layer, layer.spec.router_attr).register_forward_hook(hook_for(pos, view.rule, view.spec))
        for pos, (layer, view) in enumerate(zip(patch.layers, patch.views))
    ]
    device = next(model.parameters()).device
    try:
        model.eval()
        with torch.no_grad(), (forward_context or contextlib.nullcontext)():
            for batch in batches:
                inputs, mask_box[0] = _forward_inputs(move_data_to_device(batch, device))
                (forward or model)(**inputs)
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in flags:
            module.training = flag
    if any(len(parts) != len(batches) for parts in per_layer):
        raise RuntimeError("a MoE layer's router ran a different number of times than there were probe batches")
    return [RoutingSnapshot.cat(parts) for parts in per_layer]


class RoutingDriftCallback(Callback):
    """Track how each MoE layer's routing of a fixed probe batch moves away from the base model's.

    The probe is fixed once per fit, on every rank: the first ``probe_batches`` batches of the first
    validation dataloader, or, without one, the first training batch (taken in ``on_train_batch_start``,
    before the first optimizer step; ``probe_batches`` is then 1). Its routing by the model as it is at
    the start of training (after restoring a checkpoint of a run without this callback) is the baseline:
    per layer the selected expert set, the highest-weight selected expert and the routing distribution of
    every real token (pad tokens excluded via ``attention_mask``, or ``token_mask`` for packed batches).

    Every ``every_n_steps`` optimizer steps (0: only at the end) and at the end of training the probe is
    routed again (eval mode, no gradients, the trainer's precision context; training flags restored, no
    routing counts taken) and compared with the baseline (:mod:`moe_lab.analysis.drift_stats`):

    * ``drift/layer{i}/topk_overlap``: mean over tokens of ``|S_now & S_base| / max(|S_now|, |S_base|)``
      (``/ k`` when the set sizes agree); 1.0 iff no token's expert set changed;
    * ``drift/layer{i}/flip_rate``: fraction of tokens whose expert *set* changed;
    * ``drift/layer{i}/top1_flip_rate``: fraction of tokens whose highest-weight selected expert changed;
    * ``drift/layer{i}/entropy``: mean token entropy (nats) of the routing distribution now;
    * ``drift/layer{i}/kl``: mean token KL(base || now) of the routing distributions (nats);
    * ``drift/{stat}_mean``: the mean of each over layers.

    Under data parallelism each rank probes its own batch and the per-token sums are added over ranks
    before dividing (a collective: every rank probes at the same steps). Metrics are logged once on
    Lightning's step axis (optimizer step ``s`` at logging step ``s - 1``, like ``train/loss`` of that
    batch); ``self.latest`` holds the last ones plus ``"step"``.

    The probe and the baseline are part of the callback's checkpoint state, so a resumed run keeps
    measuring against the original base model. Under data parallelism every rank's probe and baseline are
    gathered into the checkpoint and each rank continues with its own, so the resumed run logs what an
    uninterrupted one does. (A resume on another number of ranks, allowed by ``task.allow_resume_changes``,
    probes all saved probes on every rank and counts rank zero's sums: the means cover the same tokens.)
    The end-of-training probe is taken at the last optimizer step, before its checkpoint
    (:func:`~moe_lab.callbacks._logging.ends_training`), so a run killed after that checkpoint has it logged.
    """

    def __init__(self, every_n_steps: int = 50, probe_batches: int = 1):
        super().__init__()
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0 (0: only at the end of training), got {every_n_steps}")
        if probe_batches < 1:
            raise ValueError(f"probe_batches must be >= 1, got {probe_batches}")
        self.every_n_steps = int(every_n_steps)
        self.probe_batches = int(probe_batches)
        self.probe: list[dict[str, torch.Tensor]] | None = None
        self.baseline: list[RoutingSnapshot] | None = None
        self.latest: dict[str, Any] = {}
        self._layer_indices: list[int] | None = None
        self._restored = False
        self._take_train_batch = False
        self._last_seen_step: int | None = None
        self._last_probe_step: int | None = None
        self._dense = False
        self._ranks: list[dict[str, Any]] | None = None  # every rank's probe and baseline, from a DDP checkpoint
        self._counts = True  # this rank's drift sums count (see _own_probe)

    # state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.baseline is None:
            return {}
        return {
            "probe": self.probe,
            "layers": self._layer_indices,
            "baseline": [s.to_dict() for s in self.baseline],
        }

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint) -> None:
        """Under data parallelism: every rank's probe and baseline into the checkpoint (a collective: every rank
        writes a checkpoint together, ``Trainer.save_checkpoint``)."""
        if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        mine = self.state_dict()
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, {k: mine.get(k) for k in ("probe", "baseline")} if mine else None)
        if mine and all(r is not None for r in ranks):
            checkpoint.setdefault("callbacks", {})[self.state_key] = {"layers": mine["layers"], "ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._layer_indices = list(state_dict["layers"])
        # one process (or an older moe-lab's DDP checkpoint: rank zero's probe only) saves its own at the top
        self._ranks = state_dict.get("ranks") or [{k: state_dict[k] for k in ("probe", "baseline")}]
        self.probe = self._ranks[0]["probe"]  # this rank's own is picked in on_train_start
        self.baseline = [RoutingSnapshot(**s) for s in self._ranks[0]["baseline"]]
        self._restored = True

    def _own_probe(self, trainer: pl.Trainer) -> None:
        """This rank's probe and baseline out of a DDP checkpoint's ``ranks``. On another number of ranks (said in
        one line) every rank probes all saved probes, the same forward passes on every rank (a sharded model's
        forward is a collective), and only rank zero's sums count: the means cover the same tokens."""
        ranks, self._ranks = self._ranks, None
        self._counts = True
        if ranks is None:
            return
        if len(ranks) == trainer.world_size:
            mine = [ranks[trainer.global_rank]]
        else:
            if trainer.is_global_zero:
                log.warning("RoutingDriftCallback: the checkpoint holds the routing-drift probes of %d rank(s) (an "
                            "older moe-lab kept rank zero's only), this run has %d: every rank probes all of them and "
                            "rank zero's sums are logged", len(ranks), trainer.world_size)
            mine, self._counts = ranks, trainer.is_global_zero
        self.probe = [batch for r in mine for batch in r["probe"]]
        per_layer = zip(*[[RoutingSnapshot(**s) for s in r["baseline"]] for r in mine])
        self.baseline = [RoutingSnapshot.cat(list(parts)) for parts in per_layer]

    # hooks ------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._restored:  # a new fit: a new probe and baseline
            self.probe = self.baseline = self._layer_indices = self._ranks = None
        self._restored = False
        self.latest = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        patch, _ = _patch_and_model(pl_module)
        self._last_seen_step = self._last_probe_step = trainer.global_step
        self._take_train_batch = False
        self._dense = without_moe_layers(self, pl_module)
        if self._dense:  # no routing to probe
            return
        self._own_probe(trainer)
        if self.baseline is not None:
            indices = [layer.index for layer in patch.layers]
            if indices != self._layer_indices:
                raise ValueError(
                    f"the checkpoint's routing-drift baseline has MoE layers {self._layer_indices}, this model "
                    f"{indices}: it was saved from another model"
                )
            return
        loader = _validation_loader(trainer)
        if loader is None:
            if self.probe_batches > 1:
                rank_zero_warn(
                    "RoutingDriftCallback: no validation dataloader, probing the first training batch only"
                )
            self._take_train_batch = True
            return
        batches = []
        for batch in loader:
            batches.append(_probe_batch(batch))
            if len(batches) == self.probe_batches:
                break
        if not batches:
            self._take_train_batch = True
            return
        self._set_baseline(trainer, pl_module, batches)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._take_train_batch:
            self._take_train_batch = False
            self._set_baseline(trainer, pl_module, [_probe_batch(batch)])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._dense or step == self._last_seen_step:  # dense model, or accumulating micro-batch
            return
        self._last_seen_step = step
        if (self.every_n_steps and step % self.every_n_steps == 0) or ends_training(trainer):
            self.measure(trainer, pl_module, logging_step(trainer))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.baseline is not None and trainer.global_step != self._last_probe_step:
            self.measure(trainer, pl_module, max(trainer.global_step - 1, 0), train_end=True)

    # work -------------------------------------------------------------------------------------
    def _set_baseline(self, trainer, pl_module, batches) -> None:
        patch, _ = _patch_and_model(pl_module)
        self.probe = batches
        self.baseline = capture_routing(pl_module, batches, trainer.precision_plugin.val_step_context,
                                        model_forward(trainer, pl_module))
        self._layer_indices = [layer.index for layer in patch.layers]

    def measure(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, train_end: bool = False
    ) -> dict[str, float]:
        """Probe now, compare with the baseline, log at logger ``step`` and return the metrics.

        ``train_end``: called from ``on_train_end``, where Lightning forbids ``self.log``; the metrics
        then go to the loggers directly and into ``trainer.callback_metrics`` by hand."""
        assert self.baseline is not None and self.probe is not None
        now = capture_routing(pl_module, self.probe, trainer.precision_plugin.val_step_context,
                              model_forward(trainer, pl_module))
        sums = torch.stack([drift_sums(base, cur) for base, cur in zip(self.baseline, now)])
        if not self._counts:  # a resume on another number of ranks: rank zero's sums cover every probe
            sums = torch.zeros_like(sums)
        device = next(pl_module.parameters()).device
        sums = trainer.strategy.reduce(sums.to(device), reduce_op="sum").detach().cpu()
        metrics: dict[str, float] = {}
        per_stat: dict[str, list[float]] = {name: [] for name in DRIFT_STATS}
        for index, layer_sums in zip(self._layer_indices, sums):
            for name, value in drift_means(layer_sums).items():
                metrics[f"drift/layer{index}/{name}"] = value
                per_stat[name].append(value)
        for name, values in per_stat.items():
            metrics[f"drift/{name}_mean"] = sum(values) / len(values)
        self._last_probe_step = trainer.global_step
        self.latest = {**metrics, "step": trainer.global_step}
        if train_end:
            trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(dict(metrics), step=step)
                    logger.save()
        else:
            log_metrics(trainer, pl_module, metrics, step)
        return metrics
