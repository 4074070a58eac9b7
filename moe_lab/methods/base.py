"""The base LightningModule for causal-LM post-training of an MoE model (conventional SFT and
frozen-router SFT; later methods subclass it)."""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import partial

import lightning as L
import torch
from torchmetrics.aggregation import MeanMetric

from ..core.plain import to_plain as _plain
from ..core.precision import apply_master_weights, check_mode
from ..core.settings import Optim, Schedule, read
from ..data.packing import is_packed, model_inputs, real_token_mask, verify_packing
from ..moe.aux_loss import AUX_LOSS_SCOPES, added_aux_loss, native_aux_loss_coef, switch_balance_loss
from ..runtime.ep_optimizer import DenseShardedAdamW
from ..runtime.optimizer_masters import FP32MasterCopies, masters_of, refuse_optimizer_masters
from ..runtime.refusals import check_fsdp_clipping, check_schedule_length
from ..runtime.strategies import optimizer_stepped, strategy_kind, trains_expert_slices
from .registry import apply
from .schedules import lr_multiplier, warmup_steps_for
from .slice_decay import ZeroSlicedWeightDecay, sliced_weight_decay

log = logging.getLogger(__name__)


class ExpMeanMetric(MeanMetric):
    """``exp`` of a weighted mean: perplexity from per-batch mean NLLs weighted by their token counts."""

    def compute(self) -> torch.Tensor:
        return super().compute().exp()


def supervised_tokens(batch) -> torch.Tensor:
    """Tokens the causal-LM loss averages over: labels after the one-token shift that are not -100."""
    return (batch["labels"][..., 1:] != -100).sum()


GUARD_KEY = "moe_lab_guard"  # checkpoint entry: the last finite training loss and its step


class MoELightningModule(L.LightningModule):
    """Wraps an HF MoE model patched by ``moe_lab.apply(model, method, **options)``.

    Loss is the HF causal-LM loss on response tokens (labels are -100 elsewhere). ``aux_loss_coef``: a
    number, or ``"native"`` = the family's own coefficient (:func:`~moe_lab.moe.aux_loss.native_aux_loss_coef`);
    it is mapped onto the family's aux-loss field when HF adds the loss itself, otherwise the registry's loss
    (DeepSeek: the sequence-wise balance loss) is added here, once. ``master_weights``: see
    :mod:`moe_lab.core.precision` (trainable bf16/fp16 parameters become fp32 at fit start by default).

    A subclass states what a run must know of it before it is built (read off the class its config's ``_target_``
    names: :func:`module_class`), so a method's facts live in its own module.
    """

    #: it trains any causal LM, dense or MoE (the run's model may be a dense student: :func:`moe_lab.models.load_model`)
    trains_dense_models: bool = False
    #: why it cannot run under ``hardware.ep_size > 1`` whatever its installer (None: its installer's registration
    #: decides; :mod:`.ep_support`)
    expert_parallel_refusal: str | None = None
    #: the manifest its training export always carries (None: a plain save_pretrained export); an export of such a
    #: run without it is refused as incomplete (:mod:`moe_lab.core.export_check`)
    export_manifest: str | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        method: str = "sft",
        options: dict | None = None,
        aux_loss_coef: float | str = 0.0,
        optim: dict | None = None,
        scheduler: dict | None = None,
        gradient_checkpointing: bool = False,
        name: str | None = None,
        lora: dict | None = None,
        master_weights: str = "fp32",
        aux_loss_scope: str = "global",
    ):
        super().__init__()
        self._init_training(model, method, apply(model, method, lora=_plain(lora) or None, **(_plain(options) or {})),
                            optim, scheduler, master_weights)
        self.aux_loss_coef = self._resolve_aux_loss_coef(aux_loss_coef)
        self._moe_lab_adds_aux = not self.patch.set_aux_loss_coef(self.aux_loss_coef) and self.aux_loss_coef > 0
        if aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ValueError(f"method.aux_loss_scope={aux_loss_scope!r}: choose global (the Switch loss over every "
                             "data-parallel rank's tokens, as one process on the global batch) or per_rank (each "
                             "rank's own tokens, as HF's model computes it under DDP)")
        self.aux_loss_scope = aux_loss_scope
        if gradient_checkpointing:
            model.activation_checkpointing_enable()
        self._init_guard()
        # val/loss and val/ppl: token-weighted over all batches and ranks (torchmetrics syncs at epoch end)
        self.val_loss_metric, self.val_ppl_metric = MeanMetric(), ExpMeanMetric()
        self.save_hyperparameters({  # plain containers only: checkpoints load with weights_only=True
            "name": name or method, "method": method, "options": _plain(options) or {},
            "aux_loss_coef": aux_loss_coef, "optim": self.optim, "scheduler": self.scheduler_cfg,
            "gradient_checkpointing": gradient_checkpointing, "lora": _plain(lora),
            "master_weights": master_weights, "aux_loss_scope": aux_loss_scope,
        })

    def _init_training(self, model: torch.nn.Module, method: str, patch, optim: dict | None, scheduler: dict | None,
                       master_weights: str) -> None:
        """What every module trains with, whatever its model: the model, its patch, the master-weights mode and the
        optimizer and scheduler settings (:mod:`moe_lab.core.settings`: over their defaults, each value checked; a
        dense KD student takes this without the blocks)."""
        self.model, self.method, self.patch = model, method, patch
        self.master_weights = check_mode(master_weights)
        self.optim = dataclasses.asdict(read(Optim, optim, "task.optim"))
        self.scheduler_cfg = dataclasses.asdict(read(Schedule, scheduler, "task.scheduler"))

    # ---- the non-finite guard (every method; method=kd feeds it its own window loss) -------------------------
    def _init_guard(self) -> None:
        self.last_finite_loss: float | None = None
        self.last_finite_step: int | None = None
        self._window_loss, self._window_batches = None, 0

    def check_finite_loss(self, loss: float, what: str = "training", hint: str = "lower task.optim.lr") -> None:
        """Stop before the optimizer step about to apply a window whose (all-rank) loss is not finite: its update
        would write non-finite weights into the next checkpoint. Raises ``FloatingPointError`` naming that step and
        the last finite loss (the checkpoints written so far are kept); else records ``loss`` as the last finite."""
        step = self.trainer.global_step + 1
        if not math.isfinite(loss):
            last = "none" if self.last_finite_loss is None else \
                f"{self.last_finite_loss:.6g} (step {self.last_finite_step})"
            raise FloatingPointError(
                f"method={self.hparams.get('name') or self.method}: non-finite {what} loss {loss} at optimizer step "
                f"{step}; last finite loss {last}. Stopped before this step's update: the checkpoints written so far "
                f"hold finite weights (resume one with task.resume=<run dir>/checkpoints/<file>); {hint}")
        self.last_finite_loss, self.last_finite_step = loss, step

    def on_after_backward(self):
        """At the last micro-batch of an accumulation window (Lightning's own test, DeepSpeed included): the
        window's mean loss over micro-batches and ranks (one all-reduce) through :meth:`check_finite_loss`."""
        trainer = self.trainer
        if self._window_loss is None or trainer.fit_loop._should_accumulate():
            return
        stats = torch.stack([self._window_loss.double(), torch.tensor(float(self._window_batches),
                                                                         dtype=torch.float64, device=self.device)])
        self._window_loss, self._window_batches = None, 0
        stats = trainer.strategy.reduce(stats, reduce_op="sum")
        self.check_finite_loss(float(stats[0]) / max(float(stats[1]), 1.0))

    def on_save_checkpoint(self, checkpoint):
        checkpoint[GUARD_KEY] = {"last_finite_loss": self.last_finite_loss, "last_finite_step": self.last_finite_step}

    def on_load_checkpoint(self, checkpoint):
        guard = checkpoint.get(GUARD_KEY) or {}
        self.last_finite_loss = guard.get("last_finite_loss", self.last_finite_loss)
        self.last_finite_step = guard.get("last_finite_step", self.last_finite_step)

    def _resolve_aux_loss_coef(self, coef) -> float:
        spec = self.patch.spec
        if coef == "native":
            coef = native_aux_loss_coef(spec, self.model.config)
            source = f"config.{spec.aux_loss_field}" if spec.aux_loss_field else "registry"
            log.info("aux loss: %s's native coefficient %g (%s; loss: %s)", spec.model_type, coef, source,
                     spec.aux_loss)
            return coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
            raise ValueError(f"method.aux_loss_coef={coef!r}: give a number >= 0 (0 = off) or 'native' (the "
                             "family's own coefficient)")
        return float(coef)

    def forward(self, **batch):
        return self.model(**batch)

    def configure_model(self):
        """fp32 master weights (``master_weights``), before the strategy converts or wraps the model."""
        trainer = self._trainer
        if trainer is None or trainer.state.fn != "fit":
            return
        from lightning.pytorch.strategies import DeepSpeedStrategy

        if self.master_weights == "optimizer":
            refuse_optimizer_masters(self.hparams.get("name") or self.method, strategy_kind(trainer.strategy),
                                     trainer.precision, trains_expert_slices(self))
        apply_master_weights(self.model, trainer.precision, self.master_weights,
                             optimizer_keeps_fp32=isinstance(trainer.strategy, DeepSpeedStrategy))

    def on_before_optimizer_step(self, optimizer):
        """``master_weights=optimizer``: the accumulated bf16 gradients onto the fp32 masters (after the callbacks
        read them, before Lightning clips the optimizer's parameters)."""
        masters = masters_of(optimizer)
        if masters is not None:
            masters.gradients_to_masters()

    def on_fit_start(self):
        # from_pretrained returns the model in eval mode and Lightning (2.2+) keeps the modes it is given: train
        # mode for routing statistics (condenser biases), jitter, dropout and HF's gradient checkpointing
        self.train()
        datamodule = getattr(self.trainer, "datamodule", None)
        if getattr(datamodule, "packing", False):
            verify_packing(self.model)

    def _step(self, batch, stage: str):
        mask = real_token_mask(batch)  # packed batches carry no attention mask, only their real tokens
        inputs = model_inputs(batch)
        labels = inputs.pop("labels")  # given labels, HF would fold coef * aux into out.loss
        with self.patch.context.real_tokens(mask):
            out = self.model(**inputs)
        # the token CE exactly as HF computes it inside forward; the aux term is added below, once
        lm_loss = self.model.loss_function(out.logits, labels, self.model.config.vocab_size)
        aux = getattr(out, "aux_loss", None)
        over_ranks = stage == "train" and self.aux_loss_scope == "global"  # every rank runs each training step
        if self._moe_lab_adds_aux:
            documents = torch.cumsum(batch["position_ids"] == 0, dim=1) if is_packed(batch) else None
            aux = added_aux_loss(self.patch, out.router_logits, mask, documents, over_ranks)
        elif torch.is_tensor(aux) and over_ranks and self._trainer is not None and self.trainer.world_size > 1:
            # HF's own Switch loss (the same function), over every rank's tokens
            layer = self.patch.layers[0]
            aux = switch_balance_loss(out.router_logits, layer.num_experts, layer.top_k,
                                      inputs.get("attention_mask"), over_ranks=True)
        loss = lm_loss
        if self.aux_loss_coef > 0 and torch.is_tensor(aux):  # the objective: CE + coef * aux
            loss = lm_loss + self.aux_loss_coef * aux.to(lm_loss.device)
        on_step = stage == "train"
        batch_size = batch["input_ids"].shape[0]
        if on_step:
            detached = loss.detach().float()
            self._window_loss = detached if self._window_loss is None else self._window_loss + detached
            self._window_batches += 1
            self.log(f"{stage}/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=batch_size)
            self.log(f"{stage}/lm_loss", lm_loss.detach(), on_step=True, on_epoch=False, batch_size=batch_size)
        else:  # val/loss and val/ppl: the language-model CE alone (val/aux_loss is logged apart)
            self._log_val_loss(lm_loss.detach(), supervised_tokens(batch))
        if aux is not None and torch.is_tensor(aux):
            self.log(f"{stage}/aux_loss", aux.detach(), on_step=on_step, on_epoch=not on_step,
                     sync_dist=not on_step, batch_size=batch_size)
        if on_step:
            self.log("train/tokens", mask.sum().float(), on_step=True, reduce_fx="sum",
                     batch_size=batch_size)
        return loss

    def _log_val_loss(self, loss: torch.Tensor, tokens: torch.Tensor) -> None:
        value = torch.where(tokens > 0, loss.float(), 0.0)  # a batch without labels weighs 0
        for name, metric in (("val/loss", self.val_loss_metric), ("val/ppl", self.val_ppl_metric)):
            metric.update(value, weight=tokens.float())
            self.log(name, metric, on_step=False, on_epoch=True, prog_bar=name == "val/loss")

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        return self._step(batch, "val")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Clipping by the norm over the whole model where each rank holds a part of it. Under FSDP the gradients
        are sharded and Lightning's precision plugin refuses to clip by norm: the FSDP root's ``clip_grad_norm_``
        clips by the norm over all shards. Under expert parallelism each rank's local experts are summed over its EP
        group (:meth:`~moe_lab.runtime.expert_parallel.ExpertParallel.clip_gradients`)."""
        if gradient_clip_val and strategy_kind(self.trainer.strategy) == "fsdp":
            check_fsdp_clipping("fsdp", gradient_clip_algorithm)
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        ep = getattr(getattr(self, "patch", None), "expert_parallel", None)
        if ep is not None and gradient_clip_val and gradient_clip_algorithm != "value":
            ep.clip_gradients([p for group in optimizer.param_groups for p in group["params"]], float(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, *args, **kwargs):
        """One optimizer step, then the method's per-step hooks (e.g. router-bias updates). Under DeepSpeed the
        trained expert slices' weight decay goes to the ZeRO masters first (:mod:`.slice_decay`)."""
        stepping = optimizer_stepped(self._trainer)  # DeepSpeed: Lightning calls this on every micro-batch
        if stepping and getattr(self, "zero_slice_decay", None) is not None:
            self.zero_slice_decay.before_step()
        super().optimizer_step(*args, **kwargs)
        if stepping:
            self.patch.after_optimizer_step()

    def configure_optimizers(self):
        sliced = {id(p) for p, _ in self.patch.expert_slice_masks.values()}
        decay, no_decay, masked = [], [], []
        for p in self.model.parameters():
            if p.requires_grad:
                (masked if id(p) in sliced else decay if p.dim() >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": self.optim["weight_decay"]},
                  {"params": no_decay, "weight_decay": 0.0},
                  {"params": masked, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        adamw = {"lr": self.optim["lr"], "betas": tuple(self.optim["betas"]), "eps": self.optim["eps"]}
        ep = getattr(self.patch, "expert_parallel", None)
        if ep is not None and ep.dense == "zero1":  # the dense part's state sharded over every rank
            optimizer = DenseShardedAdamW(groups, ep, **adamw)
        else:
            optimizer = torch.optim.AdamW(groups, **adamw)
        self.zero_slice_decay = None
        if masked and self.optim["weight_decay"]:
            slices, wd = self.patch.expert_slice_masks.values(), self.optim["weight_decay"]
            if self._trainer is not None and strategy_kind(self.trainer.strategy).startswith("deepspeed"):
                self.zero_slice_decay = ZeroSlicedWeightDecay(optimizer, slices, wd)  # the engine steps masters
            else:
                sliced_weight_decay(optimizer, slices, wd)
        if self.master_weights == "optimizer" and not (
                self._trainer is not None and strategy_kind(self.trainer.strategy).startswith("deepspeed")):
            FP32MasterCopies(optimizer)  # the engine keeps its own masters under DeepSpeed
        s = self.scheduler_cfg
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1
        if not math.isfinite(total):
            check_schedule_length(s, total)
            total = 1
        total = int(total)
        warmup = warmup_steps_for(total, int(s["warmup_steps"]), s["warmup_ratio"])
        schedule = partial(lr_multiplier, total_steps=total, name=s["name"], warmup_steps=warmup,
                           min_lr_ratio=float(s["min_lr_ratio"]))
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        # the learning-rate column keeps AdamW's name whichever class steps it (EP's ZeRO-1 composite included)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step",
                                                         "name": "lr-AdamW"}}
