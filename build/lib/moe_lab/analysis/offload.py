"""Analytic offload model (Condenser paper Table 4; compression spec 4.7): host -> device expert bytes per step
from a routing log, under a resident-set policy, at expert or packed-tensor granularity."""

from __future__ import annotations

from collections import OrderedDict

import torch

POLICIES = ("lru", "all_resident")
GRANULARITIES = ("expert", "packed")


def needed(counts: torch.Tensor) -> torch.Tensor:
    """[steps, layers, E] bool: experts that received at least one token in the step."""
    return counts > 0


def all_experts(counts: torch.Tensor) -> torch.Tensor:
    """DenseMixer: every expert is computed on every token, so every expert is needed every step (with a device
    cache smaller than E, :func:`fetches` then copies all E of every layer every step)."""
    return torch.ones_like(counts, dtype=torch.bool)


def fetches(need: torch.Tensor, *, policy: str, capacity: int, pinned: dict[int, list[int]] | None = None,
            granularity: str = "expert") -> torch.Tensor:
    """[steps, layers] experts copied host -> device per step.

    ``expert``: a needed expert not resident is fetched; ``lru`` holds at most ``capacity`` non-pinned experts per
    layer at any time (cold start): a layer's needed experts are visited in index order (the order HF's expert
    loop computes them) and each fetch beyond capacity evicts the least recently used one at once. A step that
    needs more experts than ``capacity`` therefore fetches every one of them (a cyclic scan defeats LRU):
    DenseMixer, needing all E, fetches E per layer per step for any capacity < E (the knob does not set its
    cost); capacity >= E keeps everything resident. ``pinned`` experts (condensers, by layer position) stay
    resident beside the cache and are never fetched after the first step; ``all_resident`` fetches nothing after
    the first step. ``packed``: the packed expert tensor is one unit: ZeRO-3 gathers all E experts of every layer on every
    pass whatever the routing, so every step fetches E per layer (no policy can save anything).
    """
    if policy not in POLICIES:
        raise ValueError(f"task.policy={policy!r}: choose one of {', '.join(POLICIES)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"task.granularity={granularity!r}: choose one of {', '.join(GRANULARITIES)}")
    if capacity < 0:
        raise ValueError(f"task.capacity={capacity} must be >= 0")
    steps, layers, num = need.shape
    if granularity == "packed":
        return torch.full((steps, layers), num, dtype=torch.long)
    out = torch.zeros(steps, layers, dtype=torch.long)
    pinned = pinned or {}
    for layer in range(layers):
        pins = set(pinned.get(layer, []))
        cache: OrderedDict[int, None] = OrderedDict()
        loaded_pins: set[int] = set()
        for s in range(steps):
            want = need[s, layer].nonzero().flatten().tolist()
            if policy == "all_resident":
                out[s, layer] = num if s == 0 else 0
                continue
            fetched = 0
            for e in want:
                if e in pins:
                    fetched += e not in loaded_pins
                    loaded_pins.add(e)
                elif e in cache:
                    cache.move_to_end(e)
                else:
                    fetched += 1
                    cache[e] = None
                    if len(cache) > capacity:
                        cache.popitem(last=False)
            out[s, layer] = fetched
    return out
