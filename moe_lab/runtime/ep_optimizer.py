"""ZeRO-1 for the dense part under expert parallelism (``hardware.ep_dense=zero1``).

Under EP every rank holds ``1 / ep_size`` of the experts, but the dense part (attention, routers, embeddings, shared
experts) is replicated, and so, under plain DDP, is its AdamW state: for Qwen3-30B-A3B, 1.5B dense parameters and
their two fp32 moments on each of 8 GPUs. :class:`DenseShardedAdamW` keeps one AdamW's param groups (what the LR
schedule, clipping and Lightning see) and steps them with two optimizers: torch's ``ZeroRedundancyOptimizer`` over
the dense parameters (each rank steps and keeps the moments of its share of them, then broadcasts them; ZeRO stage 1),
and a plain AdamW over the rank's own experts (whose gradients :class:`~.expert_parallel.ExpertParallel` reduced).
Every parameter takes torch AdamW's element-wise update from the same gradient, so the weights are those of a plain
AdamW. Its ``state_dict`` (after ``consolidate_state_dict`` on every rank, as Lightning does for ZeRO) is a plain
AdamW's of the whole model, every expert gathered, so checkpoints load under any ``ep_size`` and any ``ep_dense``.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

log = logging.getLogger(__name__)

EP_DENSE = ("zero1", "ddp")


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


class DenseShardedAdamW(torch.optim.AdamW):
    """AdamW over ``groups`` whose dense moments are sharded over every rank (ZeRO-1) and whose local experts
    (``ep.local_parameters``) are stepped on their rank. ``defaults``: AdamW's (lr, betas, eps)."""

    def __init__(self, groups: list[dict], ep, **defaults):
        super().__init__(groups, **defaults)
        local = {id(p) for p in ep.local_parameters}
        self.ep = ep
        self.inner: list[tuple[torch.optim.Optimizer, list[int]]] = []  # (optimizer, the group of each of its groups)
        for is_expert in (False, True):
            parts = [(i, {**_hyper(g), "params": [p for p in g["params"] if (id(p) in local) == is_expert]})
                     for i, g in enumerate(self.param_groups)]
            parts = [(i, g) for i, g in parts if g["params"]]
            if not parts:
                continue
            if is_expert:
                optimizer = torch.optim.AdamW([g for _, g in parts], **defaults)
                ep.attach_optimizer(optimizer)  # its state dict gathers the experts, its load keeps the local slice
            else:
                optimizer = ZeroRedundancyOptimizer([g for _, g in parts], optimizer_class=torch.optim.AdamW,
                                                    **defaults)
            self.inner.append((optimizer, [i for i, _ in parts]))
        self._experts_state = None
        zero = next((o for o, _ in self.inner if isinstance(o, ZeroRedundancyOptimizer)), None)
        if zero is not None:
            held = sum(len(g["params"]) for g in zero.optim.param_groups)
            log.info("expert parallel: the dense part's AdamW moments sharded over %d ranks (ZeRO-1, "
                     "hardware.ep_dense=zero1): %d of %d dense tensors on this rank", zero.world_size, held,
                     sum(len(g["params"]) for g in zero.param_groups))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer, owners in self.inner:
            for group, i in zip(optimizer.param_groups, owners):  # the schedule's lr (and any other setting)
                group.update(_hyper(self.param_groups[i]))
            optimizer.step()
        return loss

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect the state on rank ``to``: the dense shards (ZeRO) and the experts (gathered over the EP group).
        Every rank calls it (Lightning does, before :meth:`state_dict` on rank 0)."""
        for optimizer, _ in self.inner:
            if isinstance(optimizer, ZeroRedundancyOptimizer):
                optimizer.consolidate_state_dict(to)
            else:
                self._experts_state = optimizer.state_dict()  # a collective: the experts gathered

    def state_dict(self) -> dict:
        """A plain AdamW's state dict over this optimizer's param groups (after :meth:`consolidate_state_dict`)."""
        index, groups = {}, []
        for group in self.param_groups:
            groups.append({**_hyper(group), "params": list(range(len(index), len(index) + len(group["params"])))})
            index.update({id(p): len(index) + k for k, p in enumerate(group["params"])})
        state = {}
        for optimizer, _ in self.inner:
            inner = optimizer.state_dict() if isinstance(optimizer, ZeroRedundancyOptimizer) else self._experts_state
            if inner is None:
                raise RuntimeError("DenseShardedAdamW.state_dict before consolidate_state_dict: call it on every rank")
            params = [p for g in optimizer.param_groups for p in g["params"]]
            state.update({index[id(params[j])]: value for j, value in inner["state"].items() if value is not None})
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a plain AdamW's state dict of the whole model (any ``ep_size``, any ``ep_dense``): each rank keeps its
        dense shard and its experts' slice."""
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"optimizer state with {len(state_dict['param_groups'])} param groups for an optimizer "
                             f"with {len(self.param_groups)}")
        position = {}
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            position.update({id(p): j for p, j in zip(group["params"], saved["params"])})
        for optimizer, owners in self.inner:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            groups = [{**_hyper(self.param_groups[i]), "params": list(range(len(g["params"])))}
                      for g, i in zip(optimizer.param_groups, owners)]
            start = 0
            for group in groups:  # the inner optimizer's own indexing: consecutive over its groups
                group["params"] = [start + k for k in group["params"]]
                start += len(group["params"])
            inner = {"state": {j: state_dict["state"][position[id(p)]] for j, p in enumerate(params)
                               if position[id(p)] in state_dict["state"]}, "param_groups": groups}
            optimizer.load_state_dict(inner)
