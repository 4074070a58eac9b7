"""Decoupled (AdamW) weight decay on the trained expert slices of packed expert tensors, and on nothing else.

ESFT and LoRA-on-ESFT train some experts of a packed ``[E, ...]`` tensor: the tensor sits in a zero-decay param
group (its frozen slices get zero gradients, which Adam turns into zero updates, exactly) and the trained slices
are decayed here, BEFORE the optimizer step, as ``w *= 1 - lr * weight_decay``: torch AdamW's own first operation
of a step, so a trained slice moves bit for bit as under ``AdamW(weight_decay=wd)``.

Two places hold the values a step updates:
- a torch optimizer steps the tensors themselves (:func:`sliced_weight_decay`, a step pre-hook);
- a DeepSpeed ZeRO optimizer (stage 1-3) steps fp32 master partitions, a flat range of each tensor per rank,
  and copies them into the model's tensors after the step (:class:`ZeroSlicedWeightDecay`, called by the
  Lightning module before each real engine step): the decay is applied to the part of each trained slice that
  this rank's partition holds, so the sharded run decays exactly the elements the unsharded one does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def trained_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of the runs of consecutive True entries of ``mask`` [E] (the trained rows)."""
    runs: list[tuple[int, int]] = []
    for e in mask.nonzero().squeeze(-1).tolist():
        if runs and runs[-1][1] == e:
            runs[-1] = (runs[-1][0], e + 1)
        else:
            runs.append((e, e + 1))
    return runs


def decay_runs(flat: torch.Tensor, offset: int, row_numel: int, runs, factor: float) -> None:
    """Multiply by ``factor`` the elements of ``flat`` that belong to the rows in ``runs``. ``flat`` holds the
    elements ``[offset, offset + flat.numel())`` of a flattened tensor whose leading-axis rows each have
    ``row_numel`` elements (the whole tensor: offset 0; a ZeRO partition: its start)."""
    end = offset + flat.numel()
    for start, stop in runs:
        a, b = max(start * row_numel, offset), min(stop * row_numel, end)
        if a < b:
            flat[a - offset:b - offset].mul_(factor)


class _Sliced:
    """One packed tensor's trained runs, its row size and the index of its param group (lr is read by position:
    ``optimizer.load_state_dict``, a resume, replaces the group dicts)."""

    def __init__(self, param: torch.Tensor, mask: torch.Tensor, group: int):
        self.param, self.runs, self.group = param, trained_runs(mask.cpu()), group
        self.row_numel = param[0].numel() if param.dim() > 1 else 1


def _sliced(optimizer: torch.optim.Optimizer, masked_params) -> list[_Sliced]:
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    return [_Sliced(p, mask, group_of[id(p)]) for p, mask in masked_params]


def sliced_weight_decay(optimizer: torch.optim.Optimizer, masked_params: Iterable, weight_decay: float) -> None:
    """Decay the trained slices of ``masked_params`` (``(tensor, bool mask over its leading axis)`` pairs, each in
    a zero-decay group of ``optimizer``) before every step of ``optimizer``, as AdamW decays a whole tensor."""
    sliced = _sliced(optimizer, masked_params)

    def decay(opt, args, kwargs):
        with torch.no_grad():
            for s in sliced:
                factor = 1 - opt.param_groups[s.group]["lr"] * weight_decay
                decay_runs(s.param.detach().view(-1), 0, s.row_numel, s.runs, factor)

    optimizer.register_step_pre_hook(decay)


def zero_master_fragment(param: torch.Tensor) -> tuple[torch.Tensor | None, int, bool]:
    """``(fp32 master elements of param this rank's ZeRO optimizer holds (1-D), their offset in the flattened
    param, whether they are a copy to write back)``; ``(None, 0, False)`` where this rank holds none."""
    if hasattr(param, "ds_id"):  # ZeRO-3: every parameter split evenly over the ranks of its group
        import torch.distributed as dist
        from deepspeed.utils import safe_get_local_fp32_param

        local = safe_get_local_fp32_param(param)
        if local is None:
            return None, 0, False
        rank = dist.get_rank(group=getattr(param, "ds_process_group", None))
        return local, rank * param.ds_tensor.ds_numel, True
    mapping = getattr(param, "_hp_mapping", None)  # ZeRO-1/2: a fragment of the rank's flat fp32 partition
    if mapping is None:
        return None, 0, False
    return mapping.get_hp_fragment(), mapping.lp_fragment_address.start, False


class ZeroSlicedWeightDecay:
    """The trained slices' decay under a DeepSpeed ZeRO optimizer: build it with the torch optimizer handed to
    DeepSpeed (whose param groups the schedule updates) before the engine wraps it; call :meth:`before_step` once
    before each real engine step (not on accumulation micro-batches)."""

    def __init__(self, optimizer: torch.optim.Optimizer, masked_params: Iterable, weight_decay: float):
        self.optimizer, self.weight_decay = optimizer, float(weight_decay)
        self.sliced = _sliced(optimizer, masked_params)

    def before_step(self) -> None:
        with torch.no_grad():
            for s in self.sliced:
                flat, offset, copy = zero_master_fragment(s.param)
                if flat is None:
                    continue
                factor = 1 - self.optimizer.param_groups[s.group]["lr"] * self.weight_decay
                decay_runs(flat, offset, s.row_numel, s.runs, factor)
                if copy:  # ZeRO-3 hands a copy where the master lives elsewhere (optimizer offload)
                    from deepspeed.utils import safe_set_local_fp32_param

                    safe_set_local_fp32_param(s.param, flat)
