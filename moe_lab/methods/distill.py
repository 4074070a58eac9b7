"""method=kd: knowledge distillation of the run's model (the student) from a frozen teacher (spec 2.9).

Loss (token sums, then one normalisation): ``kd_ratio * D(teacher, student) + hidden_weight * MSE_hidden +
(1 - kd_ratio) * CE(labels)``, divided by N = the real tokens of the WHOLE global batch (every micro-batch of the
accumulation window on every rank), so a step equals one large batch whatever the token counts.

N is known before backward (as HF Trainer's ``num_items_in_batch``): the train loader (a ``ResumableDataLoader``,
put in window mode at train start) stamps each batch with its window's real tokens, all-reduced here, and the
micro-batch loss is ``sum * loss_scale / N``, ``loss_scale`` cancelling the divisions Lightning and the strategy
apply (see ``loss_scale``). Exact under DDP, FSDP and DeepSpeed ZeRO, whose gradients are reduced or sharded
inside backward. Batches without a window count (a plain DataLoader) fall back to scaling the accumulated
gradients by A * world / N after the window's last backward: single device and DDP only (``normalisation``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import lightning as L
import torch

from ..analysis.estimate import CostContext, expert_sum, register_cost_row
from ..core.plain import to_plain as _plain
from ..data.packing import model_inputs, real_token_mask
from ..distill.losses import chunked_head_kd, hidden_mse_sum
from ..distill.teacher import load_teacher, weight_rule_name, widen_teacher
from ..moe.patch import MoEPatch, atomic_export
from ..moe.stats import TokenContext
from ..runtime.refusals import EXPORT_ONLY
from .base import MoELightningModule

log = logging.getLogger(__name__)

LOSSES = {"forward_kl": "forward_kl", "fkl": "forward_kl", "reverse_kl": "reverse_kl", "rkl": "reverse_kl",
          "jsd": "jsd", "fkl_hidden": "forward_kl"}
# fkl_hidden's hidden-state term (A2-10; the paper gives no weight): ``balanced`` (Minitron as NVIDIA's
# Megatron-LM implements it, LogitsAndIntermediatesLossBalancer: the layer-mean MSE rescaled every micro-batch by
# the detached ratio KD term / MSE, so it starts and stays equal in value to the KD term, times hidden_weight) |
# ``layer_mean`` (hidden_weight x the layer-mean MSE) | ``layer_sum`` (hidden_weight x the MSE summed over layers).
HIDDEN_NORMS = ("balanced", "layer_mean", "layer_sum")
DEFAULTS = {"loss": "forward_kl", "temperature": 1.0, "beta": 0.5, "hidden_weight": 1.0, "hidden_norm": "balanced",
            "kd_ratio": 1.0,
            "chunk_size": 1024, "teacher_top_k": None, "teacher_weight_rule": "family", "teacher_logits": None}


class _DensePatch:
    """What MoELightningModule and the callbacks need of a patch, for a student without MoE layers (e.g. a
    to_dense result): no layers, no routing statistics."""

    parameter_groups = MoEPatch.parameter_groups

    def __init__(self, model):
        self.model = model
        self.views: list = []
        self.layers: list = []
        self.context = TokenContext()
        self.expert_slice_masks: dict = {}
        self.export_state_dict = None  # as MoEPatch: what export writes (set for the load dtype, LoRA merges)
        self.export_hooks: list = []  # as MoEPatch: called with the finished export folder (e.g. W&B upload)

    def after_optimizer_step(self) -> None:
        pass

    def export(self, path, tokenizer=None) -> Path:
        """``export_compressed`` (vanilla-loadable, with the compression manifest) of ``export_state_dict``,
        then the export hooks, written to a temporary folder that replaces ``path`` only when complete."""
        from ..compress.dense import export_compressed

        def write(tmp: Path) -> None:
            state_dict = self.export_state_dict() if self.export_state_dict else None
            export_compressed(self.model, tmp, tokenizer, state_dict=state_dict)

        return atomic_export(path, write, self.export_hooks)


def _has_moe(model) -> bool:
    from ..moe.registry import family_spec

    try:
        family_spec(model.config.model_type)
    except (KeyError, ValueError):
        return False
    return any(type(m).__name__ == family_spec(model.config.model_type).block_class for m in model.modules())


def decoder_layers(model) -> list:
    return list(model.base_model.layers)


class _Recorder:
    """Forward hooks keeping each decoder layer's residual-stream output."""

    def __init__(self, model, active: bool):
        self.states: list[torch.Tensor] = []
        self.handles = [layer.register_forward_hook(self._keep) for layer in decoder_layers(model)] if active else []

    def _keep(self, module, args, output):
        self.states.append(output[0] if isinstance(output, tuple) else output)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def normalisation(strategy, windowed: bool) -> str:
    """How method=kd divides by the global token count N under ``strategy``: ``"loss"`` when the batch carries
    its window's token count (exact on every strategy), else ``"gradients"`` (accumulated gradients scaled after
    the window's last backward), which needs whole gradients in ``p.grad``: single device or DDP only."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    if windowed:
        return "loss"
    if isinstance(strategy, SingleDeviceStrategy) or (isinstance(strategy, DDPStrategy)
                                                      and not isinstance(strategy, DeepSpeedStrategy)):
        return "gradients"
    raise ValueError(
        f"method=kd under {type(strategy).__name__}: the training batches carry no 'window_tokens', and the "
        "gradients cannot be rescaled after backward (DeepSpeed ZeRO and FSDP reduce and shard them inside "
        "backward). Train from a moe_lab.data.resumable.ResumableDataLoader (the train loader of every moe-lab "
        "datamodule): method=kd puts it in window mode, which counts each accumulation window's tokens before "
        "backward")


def loss_scale(strategy, accumulate: int, world_size: int) -> float:
    """``c`` such that micro-batch losses ``c * sum / N`` give the gradient of (sum over the global window) / N
    once the divisors on the way are applied: Lightning divides training_step's loss by accumulate_grad_batches
    (loops/optimization/automatic.py ``_training_step`` -> ``ClosureResult.from_training_step_output``, every
    strategy); DDP, FSDP and DeepSpeed average the gradients over the ``world_size`` data-parallel ranks. Under
    DeepSpeed with Lightning's own precision plugin, ``engine.backward`` divides by ``gradient_accumulation_steps``
    once more (runtime/engine.py ``backward``, ``scale_wrt_gas=True``); moe-lab's DeepSpeed strategies carry
    ``moe_lab.runtime.strategies.AccumulateOnceDeepSpeedPrecision``, which turns that second division off."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from ..runtime.strategies import AccumulateOnceDeepSpeedPrecision

    c = int(accumulate) * int(world_size)
    if isinstance(strategy, DeepSpeedStrategy) and not isinstance(strategy._precision_plugin,
                                                                  AccumulateOnceDeepSpeedPrecision):
        c *= int((strategy.config or {}).get("gradient_accumulation_steps") or accumulate)
    return float(c)


PER_BATCH = ("hidden_weight",)  # kd_sums entries that are not token sums (logged as they are)


def hidden_term_weight(norm: str, weight: float, kd_sum: torch.Tensor, mse_sum: torch.Tensor):
    """The multiplier of the hidden MSE token sum: ``weight`` (layer_mean / layer_sum) or, ``balanced``,
    ``weight * kd_sum / mse_sum`` (both detached; ``weight`` when the MSE is 0), the weighted term then equal in
    value to ``weight`` x the KD term."""
    if norm != "balanced":
        return weight
    if float(mse_sum) <= 0.0:
        return weight
    return weight * (kd_sum / mse_sum)


class KDModule(MoELightningModule):
    """Distil ``model`` (student, all parameters trainable) from ``teacher`` (frozen, eval, no gradients).

    ``teacher``: a loaded module, a ``conf/model`` entry or a checkpoint path. ``options``: loss
    (forward_kl | reverse_kl | jsd | fkl_hidden), temperature, beta (jsd), hidden_weight / hidden_norm (fkl_hidden:
    balanced | layer_mean | layer_sum, see ``HIDDEN_NORMS``),
    kd_ratio (weight of the KD term; 1 - kd_ratio on the student's CE on labels), chunk_size (tokens per
    lm-head chunk), teacher_top_k (k', null = the teacher's k), teacher_weight_rule (family | paper_eq6, alias raw),
    teacher_logits (a ``task=teacher_logits`` file: the teacher recorded over this run's batches, per rank and
    split, read through ``RecordedTeacher``, which refuses batches other than the recorded ones; no live teacher).
    ``export_only``: the student alone, neither teacher nor record loaded (to convert or export a checkpoint; a fit
    is refused).
    """

    trains_dense_models = True  # the student: the run's model, dense (an MoE -> dense conversion) or MoE
    expert_parallel_refusal = "the teacher and the dense student are not expert parallel"

    def __init__(self, model, teacher=None, options: dict | None = None, optim: dict | None = None,
                 scheduler: dict | None = None, gradient_checkpointing: bool = False, name: str = "kd",
                 method: str = "sft", master_weights: str = "fp32", lora: dict | None = None,
                 export_only: bool = False):
        opts = _plain(options) or {}
        unknown = sorted(set(opts) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"method.options: unknown option(s) {unknown}; kd accepts {sorted(DEFAULTS)}")
        self.kd = {**DEFAULTS, **opts}
        if self.kd["loss"] not in LOSSES:
            raise ValueError(f"method.options.loss={self.kd['loss']!r}: choose one of {', '.join(LOSSES)}")
        self.kd["teacher_weight_rule"] = weight_rule_name(self.kd["teacher_weight_rule"])
        if self.kd["hidden_norm"] not in HIDDEN_NORMS:
            raise ValueError(f"method.options.hidden_norm={self.kd['hidden_norm']!r}: choose one of "
                             f"{', '.join(HIDDEN_NORMS)}")
        if not 0.0 <= float(self.kd["kd_ratio"]) <= 1.0:
            raise ValueError(f"method.options.kd_ratio={self.kd['kd_ratio']} must be in [0, 1]")
        if _has_moe(model):
            super().__init__(model, method=method, options=None, aux_loss_coef=0.0, optim=optim,
                             scheduler=scheduler, gradient_checkpointing=gradient_checkpointing, name=name,
                             lora=lora, master_weights=master_weights)
        else:  # a dense student: the base module's state without moe-lab blocks
            if lora:
                raise ValueError("method.lora with a dense student is not supported by method=kd")
            L.LightningModule.__init__(self)
            self._init_training(model, method, _DensePatch(model), optim, scheduler, master_weights)
            self.aux_loss_coef, self._moe_lab_adds_aux, self.aux_loss_scope = 0.0, False, "global"
            if gradient_checkpointing:
                model.gradient_checkpointing_enable()
            self.save_hyperparameters({"name": name, "method": method, "options": dict(self.kd),
                                       "optim": self.optim, "scheduler": self.scheduler_cfg,
                                       "gradient_checkpointing": gradient_checkpointing,
                                       "master_weights": master_weights})
        self.record = None  # a RecordedTeacher (method.options.teacher_logits)
        self.export_only = bool(export_only)  # the student alone (no teacher, no record): converting a checkpoint
        if self.export_only:
            self._teacher = [None]
        elif self.kd["teacher_logits"]:
            self._use_record()
            self._teacher = [None]
        else:
            self._teacher = [load_teacher(teacher)]  # a list: not a submodule (never trained or checkpointed)
        self.teacher_patch = None
        if self.kd["teacher_top_k"] is not None and not self.export_only:
            self.teacher_patch = widen_teacher(self.teacher, int(self.kd["teacher_top_k"]),
                                               self.kd["teacher_weight_rule"])
        if self.record is None and not self.export_only:
            self._check_pair()
        self._window_sum = 0.0
        self._window_tokens = 0
        self._init_guard()  # the dense-student path skips the base __init__
        self.kd_stats: dict[str, float] = {}

    def _use_record(self) -> None:
        from ..distill.teacher_logits import RecordedTeacher

        if self.uses_hidden or self.kd["teacher_top_k"] is not None or float(self.kd["kd_ratio"]) != 1.0:
            raise ValueError("method.options.teacher_logits (a precomputed teacher) works with a logit loss only: "
                             "unset fkl_hidden / teacher_top_k / kd_ratio < 1")
        self.record = RecordedTeacher(self.kd["teacher_logits"])
        vs = self.model.get_output_embeddings().weight.shape[0]
        if self.record.vocab is not None and self.record.vocab != vs:
            raise ValueError(f"student vocabulary {vs} != teacher vocabulary {self.record.vocab} (teacher_logits)")

    def _record_kd(self, batch: dict, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """KD against the recorded rows of this batch (train: the run's cursor; validation: the val section)."""
        from ..distill.teacher_logits import kd_loss_from_record

        split = self.record.split_for(self._trainer)
        n = int(mask.sum())
        if split is None:  # a validation already under way when a record without val batches switched it off
            zero = mask.new_zeros((), dtype=torch.float32)
            return {"loss": zero, "div": zero, "tokens": mask.sum() * 0}
        part = self.record.next(split, batch["input_ids"], n, datamodule=getattr(self._trainer, "datamodule", None))
        inputs = model_inputs(batch)
        inputs.pop("labels", None)
        with self.patch.context.real_tokens(mask):
            logits = self.model(**inputs).logits
        div = kd_loss_from_record(logits, part, kind=self.kind, temperature=float(self.kd["temperature"]),
                                  mask=mask) * n
        return {"loss": div, "div": div.detach(), "tokens": mask.sum()}

    @property
    def teacher(self):
        return self._teacher[0]

    @property
    def kind(self) -> str:
        return LOSSES[self.kd["loss"]]

    @property
    def uses_hidden(self) -> bool:
        return self.kd["loss"] == "fkl_hidden"

    def _check_pair(self) -> None:
        vs = self.model.get_output_embeddings().weight.shape[0]
        vt = self.teacher.get_output_embeddings().weight.shape[0]
        if vs != vt:
            raise ValueError(f"student vocabulary {vs} != teacher vocabulary {vt} (method.teacher): logit "
                             "distillation needs the same tokenizer and vocabulary")
        if self.uses_hidden:
            hs, ht = self.model.config.hidden_size, self.teacher.config.hidden_size
            ls, lt = len(decoder_layers(self.model)), len(decoder_layers(self.teacher))
            if hs != ht or ls != lt:
                raise ValueError(f"method.options.loss=fkl_hidden: student hidden size {hs} / {ls} layers vs "
                                 f"teacher {ht} / {lt} layers; hidden MSE needs equal sizes (use forward_kl)")

    def configure_callbacks(self):
        from ..callbacks.kd import KDMetrics

        return [KDMetrics()]

    def _move_teacher(self) -> None:
        if self.teacher is None:
            return
        if next(self.teacher.parameters()).device != self.device:
            self.teacher.to(self.device)
        self.teacher.eval()

    def on_fit_start(self):
        if self.export_only:
            raise ValueError(EXPORT_ONLY)
        if self.record is not None:  # a record for another data-parallel size W is refused before any work
            shard = self.trainer.distributed_sampler_kwargs
            self.record.bind(*((int(shard["num_replicas"]), int(shard["rank"])) if shard else (1, 0)))
        super().on_fit_start()
        self.model.train()  # from_pretrained returns eval mode
        self._move_teacher()

    def on_validation_start(self):
        self._move_teacher()
        if self.record is not None:
            self.record.restart("val")  # every validation run reads the recorded val batches from the start

    # the loss ------------------------------------------------------------------------------------------
    def kd_sums(self, batch: dict) -> dict[str, torch.Tensor]:
        """Token sums of one micro-batch: ``loss`` (to be divided by the global token count), ``div``,
        ``kl`` (forward KL at tau = 1, monitoring), ``top1`` matches, ``hidden`` MSE, ``ce``, ``tokens``."""
        mask = real_token_mask(batch).bool()
        if self.record is not None:
            return self._record_kd(batch, mask)
        inputs = model_inputs(batch)
        labels = inputs.pop("labels", None)
        hidden = self.uses_hidden
        with torch.no_grad(), _Recorder(self.teacher, hidden) as rec_t:
            t_out = self.teacher.base_model(**inputs)
        with self.patch.context.real_tokens(mask), _Recorder(self.model, hidden) as rec_s:
            s_out = self.model.base_model(**inputs)
        ratio = float(self.kd["kd_ratio"])
        shifted = None
        if ratio < 1.0 and labels is not None:
            shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        loss, div, ce, top1 = chunked_head_kd(
            s_out.last_hidden_state, t_out.last_hidden_state, self.model.get_output_embeddings(),
            self.teacher.get_output_embeddings(), kind=self.kind, temperature=float(self.kd["temperature"]),
            mask=mask, chunk_size=self.kd["chunk_size"], beta=float(self.kd["beta"]), labels=shifted,
            kd_weight=ratio, ce_weight=1.0 - ratio)
        out = {"div": div, "top1": top1, "tokens": mask.sum(), "ce": ce}
        if hidden:
            norm = self.kd["hidden_norm"]
            mse = hidden_mse_sum(rec_s.states, rec_t.states, mask, layers="sum" if norm == "layer_sum" else "mean")
            weight = hidden_term_weight(norm, float(self.kd["hidden_weight"]), ratio * div.detach(), mse.detach())
            loss = loss + weight * mse
            out["hidden"] = mse.detach()
            out["hidden_weight"] = weight.detach() if torch.is_tensor(weight) else torch.tensor(weight)
        out["loss"] = loss
        if self.kind == "forward_kl" and float(self.kd["temperature"]) == 1.0:
            out["kl"] = out["div"]
        return out

    #: how the last training micro-batch was normalised: "loss" (window count) or "gradients" (fallback)
    normalised_by: str | None = None
    _global_window: int | None = None  # N of the current window (all ranks), announced by the loader

    def on_train_start(self):
        super().on_train_start()
        self._count_windows()

    def on_train_epoch_start(self):
        super().on_train_epoch_start()
        self._count_windows()  # a reloaded loader, or a changed accumulate_grad_batches

    def _count_windows(self) -> None:
        """Put the trainer's train loader (if a ResumableDataLoader) in window mode: Lightning's accumulation
        windows, cut at the epoch's batch limit. Called before the epoch's first batch is drawn."""
        from ..data.resumable import ResumableDataLoader

        trainer = self.trainer
        loader = trainer.train_dataloader
        if not isinstance(loader, ResumableDataLoader):
            return
        size, limit = trainer.accumulate_grad_batches, trainer.num_training_batches
        limit = int(limit) if math.isfinite(limit) else None
        if trainer.strategy.handles_gradient_accumulation and size > 1 and limit is not None and limit % size:
            raise ValueError(
                f"method=kd under {type(trainer.strategy).__name__}: an epoch of {limit} batches is not a whole "
                f"number of accumulation windows (trainer.accumulate_grad_batches={size}); DeepSpeed would carry "
                "the last window into the next epoch. Set trainer.limit_train_batches to a multiple of "
                f"{size} (e.g. {limit - limit % size or size}) or change dataset.batch_size")
        loader.count_windows(size, limit)

    def _train_loss(self, batch, loss_sum: torch.Tensor) -> torch.Tensor:
        """What one training micro-batch returns: ``loss_sum * loss_scale / N`` when the batch carries its
        window's token count (N = that count summed over ranks, one all-reduce), else the sum itself (the
        gradients are scaled in ``on_after_backward``)."""
        from ..data.resumable import WINDOW_TOKENS

        trainer = self.trainer
        local = batch.get(WINDOW_TOKENS) if isinstance(batch, dict) else None
        self.normalised_by = normalisation(trainer.strategy, windowed=local is not None)
        if local is None:
            return loss_sum
        count = torch.tensor(int(local), dtype=torch.int64, device=self.device)
        self._global_window = int(trainer.strategy.reduce(count, reduce_op="sum"))
        scale = loss_scale(trainer.strategy, trainer.accumulate_grad_batches, trainer.world_size)
        return loss_sum * (scale / max(self._global_window, 1))

    def _step(self, batch, stage: str):
        sums = self.kd_sums(batch)
        n = sums["tokens"].clamp(min=1).float()
        self.kd_stats = {k: (v.float() if k in PER_BATCH else v.float() / n).item() for k, v in sums.items()
                         if k not in ("loss", "tokens")}
        if stage == "train":
            self._window_sum += float(sums["loss"].detach())
            self._window_tokens += int(sums["tokens"])
            return self._train_loss(batch, sums["loss"])
        self.log("val/loss", sums["loss"].detach() / n, on_epoch=True, sync_dist=True,
                 batch_size=batch["input_ids"].shape[0])
        return sums["loss"] / n

    def on_after_backward(self):
        """At the last micro-batch of an accumulation window (Lightning's own test; under DeepSpeed too, where
        ``_should_accumulate()`` is False exactly at ``accumulate_grad_batches`` boundaries), before any
        on_before_optimizer_step hook: log the window's normalised loss, stop on a non-finite one before the
        optimizer step, check the loader's window count against the tokens seen, or (fallback) normalise the
        accumulated gradients by the global real-token count. Under DeepSpeed, refuse a window out of step with
        the engine's."""
        trainer = self.trainer
        window_end = not trainer.fit_loop._should_accumulate()  # Lightning's own test (automatic optimisation)
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        if hasattr(engine, "is_gradient_accumulation_boundary") and engine.is_gradient_accumulation_boundary() \
                != window_end:
            raise RuntimeError(
                f"method=kd: DeepSpeed's accumulation window is out of step with Lightning's at optimizer step "
                f"{trainer.global_step + 1} (the engine counts micro-batches from its start, so a run resumed from "
                "a checkpoint written inside a window, e.g. on a signal, is shifted): resume from a checkpoint "
                "written at an optimizer step (checkpoints/last.ckpt or step-<n>.ckpt)")
        if not window_end:
            return
        stats = torch.tensor([self._window_sum, float(self._window_tokens)], dtype=torch.float64,
                             device=self.device)
        stats = trainer.strategy.reduce(stats, reduce_op="sum")
        total, seen = float(stats[0]), int(stats[1])
        tokens = max(float(seen), 1.0)
        self._window_sum, self._window_tokens = 0.0, 0
        loss = total / tokens
        self.check_finite_loss(loss, "distillation", "lower task.optim.lr or check the teacher's logits")
        if self.normalised_by == "gradients":
            factor = trainer.accumulate_grad_batches * trainer.world_size / tokens
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
        elif self._global_window != seen:
            raise RuntimeError(
                f"method=kd: the train loader announced {self._global_window} real tokens for the accumulation "
                f"window ending at optimizer step {trainer.global_step + 1}, the micro-batches held {seen}: its "
                "windows are not the trainer's accumulation windows (was the loader iterated elsewhere too?)")
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=1)
        self.log("train/tokens", tokens, on_step=True, batch_size=1)

    def on_save_checkpoint(self, checkpoint):
        super().on_save_checkpoint(checkpoint)
        state = checkpoint.setdefault("moe_lab_kd", {})
        if self.record is not None:
            state["teacher_logits"] = self.record.state_dict()

    def on_load_checkpoint(self, checkpoint):
        """Resume the teacher record's train cursor (and the last finite loss) where the checkpoint left them."""
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("moe_lab_kd") or {}
        self.last_finite_loss = state.get("last_finite_loss", self.last_finite_loss)  # written before moe_lab_guard
        if self.record is not None:
            if "teacher_logits" not in state and checkpoint.get("global_step"):
                raise ValueError("method.options.teacher_logits: the checkpoint has no teacher-record position (it "
                                 "was not written by a run distilling from a record); resume it with the live teacher")
            self.record.load_state_dict(state.get("teacher_logits") or {"train_batches": 0})


# the estimate's rows of KD and of the dense student alone (moe_lab.analysis.estimate), priced on the student


def _student_costs(ctx: CostContext):
    """``(student counts, forward, backward FLOPs per token)`` of the MoE -> dense student."""
    s_counts, s_trained = ctx.student
    st = s_trained.tokens
    s_f = s_trained.total("forward") / st + expert_sum(s_counts, lambda s: s.top_k)
    s_b = s_trained.total("backward") / st + 2 * expert_sum(s_counts, lambda s: s.top_k)
    return s_counts, s_f, s_b


@register_cost_row("kd", order=70)
def kd_costs(ctx: CostContext) -> dict | None:
    """The teacher's forward at k' (no grad) + the dense student's forward and backward; the teacher's weights
    held beside the student. None without a student."""
    if ctx.student is None:
        return None
    s_counts, s_f, s_b = _student_costs(ctx)
    kp = ctx.opts.kd_teacher_top_k
    teacher_f = ctx.f_rest + ctx.experts(lambda s: kp or s.top_k)
    return ctx.row(s_f + teacher_f, s_b, s_counts.total, sum(s.top_k for s in s_counts.experts),
                   note=f"teacher forward at k'={kp or 'k'} (no grad) + dense student forward/backward",
                   on_student=True, teacher_params=ctx.counts.total)


@register_cost_row("dense_student", order=80)
def dense_student_costs(ctx: CostContext) -> dict | None:
    """The MoE -> dense student trained alone. None without a student."""
    if ctx.student is None:
        return None
    s_counts, s_f, s_b = _student_costs(ctx)
    return ctx.row(s_f, s_b, s_counts.total, sum(s.top_k for s in s_counts.experts),
                   note="the MoE -> dense student trained alone", on_student=True)
