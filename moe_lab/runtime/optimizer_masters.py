"""``method.master_weights=optimizer``: the model keeps its half-precision (bf16) weights for compute, the optimizer
steps fp32 master copies of the trained ones (as DeepSpeed's bf16 engine and Megatron do).

Under ``fp32`` (the default) the trained parameters themselves become fp32 and bf16 autocast casts each of them on
every forward (moe-lab casts the packed expert tensors itself, :func:`~moe_lab.moe.block.autocast_expert_weights`),
so every micro-step reads the fp32 weights once and writes a bf16 copy, and the backward accumulates fp32 gradients.
Here the weights are already bf16: the casts disappear and the gradients are bf16 tensors. Per optimizer step:

1. the micro-batches' gradients accumulate in the parameters' ``.grad``, in bf16 (as DDP reduces them);
2. at ``on_before_optimizer_step`` (after the callbacks read them, before clipping) each gradient is cast once to
   fp32 onto its master and dropped from the parameter (:meth:`FP32MasterCopies.gradients_to_masters`);
3. the optimizer (and Lightning's gradient clipping, which clips the optimizer's parameters) works on the masters;
4. after the step each master is rounded once into its bf16 parameter.

The masters travel in the optimizer's ``state_dict`` (key ``moe_lab_fp32_masters``), so a resumed run continues
from the exact fp32 values, bit for bit. Memory per trained parameter: 2 (bf16 weight) + 4 (master) + 4 (fp32
gradient, only inside the step) + 8 (AdamW) bytes, against 4 + 4 + 8 under ``fp32``.
"""

from __future__ import annotations

import torch

STATE_KEY = "moe_lab_fp32_masters"
HALF = (torch.bfloat16, torch.float16)


class FP32MasterCopies:
    """fp32 masters in place of the half-precision tensors of ``optimizer``'s param groups (build it before the
    optimizer's first step or state load); the optimizer steps the masters and each step is rounded back."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in optimizer.param_groups:
            params = []
            for param in group["params"]:
                if param.dtype in HALF:
                    master = param.detach().float()  # a new fp32 leaf
                    self.pairs.append((param, master))
                    param = master
                params.append(param)
            group["params"] = params
        optimizer.register_step_post_hook(self._round_into_parameters)
        optimizer.register_state_dict_post_hook(self._save)
        optimizer.register_load_state_dict_pre_hook(self._load)
        optimizer.moe_lab_masters = self

    def __len__(self) -> int:
        return len(self.pairs)

    def gradients_to_masters(self) -> None:
        """Each parameter's accumulated gradient, cast once to fp32, becomes its master's (and leaves the
        parameter, whose bf16 buffer is freed before the step)."""
        for param, master in self.pairs:
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None

    @torch.no_grad()
    def _round_into_parameters(self, *_) -> None:
        for param, master in self.pairs:
            param.copy_(master)

    def _save(self, optimizer, state_dict: dict) -> dict:
        state_dict[STATE_KEY] = [master.detach().clone() for _, master in self.pairs]
        return state_dict

    def _load(self, optimizer, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        saved = state_dict.pop(STATE_KEY, None)
        if saved is None:
            raise ValueError(
                "this checkpoint's optimizer state holds no fp32 master copies: it was written with "
                "method.master_weights=fp32 (or off), and this run keeps them in the optimizer "
                "(method.master_weights=optimizer). Resume with the checkpoint's own method.master_weights, or start "
                "a new run from its weights")
        shapes = [tuple(m.shape) for _, m in self.pairs]
        if [tuple(t.shape) for t in saved] != shapes:
            raise ValueError(f"the checkpoint holds {len(saved)} fp32 master copies of other shapes than this run's "
                             f"{len(shapes)} trained half-precision tensors: resume with the model and method that "
                             "wrote it")
        with torch.no_grad():
            for (param, master), value in zip(self.pairs, saved):
                master.copy_(value)
                param.copy_(master)
        return state_dict


def refuse_optimizer_masters(method: str, kind: str, precision: str | None, trains_slices: bool) -> None:
    """Where ``method.master_weights=optimizer`` cannot run: ``kind`` is :func:`~.strategies.strategy_kind`'s name,
    ``precision`` Lightning's, ``trains_slices`` whether the method steps only some expert slices (ESFT)."""
    where = f"method.master_weights=optimizer with method={method}"
    if kind.startswith("deepspeed"):
        return  # the engine steps its own fp32 masters of the bf16 weights: the same arrangement, already
    if kind == "fsdp":
        raise ValueError(f"{where} under hardware=fsdp: FSDP's MixedPrecision already computes in bf16 over fp32 "
                         "shards; use method.master_weights=fp32")
    if str(precision) != "bf16-mixed":
        raise ValueError(f"{where} at trainer.precision={precision}: the bf16 weights compute under bf16 autocast "
                         "only (16-mixed's loss scaler unscales before the masters get their gradients); set "
                         "hardware.trainer.precision=bf16-mixed, or method.master_weights=fp32")
    if trains_slices:
        raise ValueError(f"{where}: the method steps only the trained slices of packed expert tensors through its "
                         "own slice optimizer and slice decay, which act on the parameters themselves; use "
                         "method.master_weights=fp32")


def masters_of(optimizer) -> FP32MasterCopies | None:
    """The :class:`FP32MasterCopies` attached to ``optimizer`` (or to the optimizer a Lightning wrapper holds)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return getattr(optimizer, "moe_lab_masters", None)
