"""Logit-lens KL between teacher and student per group of decoder layers (the KD callback's ``kd/kl_group_<i>``).

The decoder layers are cut into ``groups`` equal consecutive groups (fewer when there are fewer layers); at the
output of each group's last layer both models' hidden states go through their own final norm
(``base_model.norm``) and ``lm_head``, and the forward KL(p_T || p_S) at tau = 1 of the two next-token
distributions is averaged over real tokens. The last group is the models' real output (their KD KL).
Chunked over tokens: full-vocabulary logits of at most one chunk per model exist at a time.
"""

from __future__ import annotations

import torch

from .losses import _flat, _mask, token_divergence


def group_ends(num_layers: int, groups: int) -> list[int]:
    """0-based index of the last decoder layer of each of ``min(groups, num_layers)`` equal groups."""
    if groups < 1:
        raise ValueError(f"callbacks.kd.layer_groups={groups} must be >= 1")
    groups = min(groups, num_layers)
    return [(g + 1) * num_layers // groups - 1 for g in range(groups)]


def _layers(model) -> list:
    return list(model.base_model.layers)


def _head(model):
    norm = getattr(model.base_model, "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__} has no final norm at base_model.norm: no logit-lens KL")
    head = model.get_output_embeddings()
    return lambda h: head(norm(h))


@torch.no_grad()
def _group_states(model, inputs: dict, ends: list[int]) -> list[torch.Tensor]:
    layers, states, handles = _layers(model), {}, []
    for end in ends:
        def keep(module, args, output, end=end):
            states[end] = output[0] if isinstance(output, tuple) else output
        handles.append(layers[end].register_forward_hook(keep))
    try:
        model.base_model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return [states[end] for end in ends]


@torch.no_grad()
def layer_group_kl(student, teacher, inputs: dict, mask: torch.Tensor | None = None, groups: int = 4,
                   chunk_size: int | None = 1024) -> list[float]:
    """Mean forward KL(p_T || p_S) over real tokens at the end of each layer group (see the module docstring).

    ``inputs``: model keyword arguments (no labels); both models must have the same number of decoder layers.
    """
    ls, lt = len(_layers(student)), len(_layers(teacher))
    if ls != lt:
        raise ValueError(f"layer-group KL: student has {ls} decoder layers, teacher {lt} (needs equal counts)")
    ends = group_ends(ls, groups)
    head_s, head_t = _head(student), _head(teacher)
    out = []
    for hs, ht in zip(_group_states(student, inputs, ends), _group_states(teacher, inputs, ends)):
        hs, ht = _flat(hs), _flat(ht)
        keep = _mask(mask, hs.shape[0], hs.device)
        hs, ht = hs[keep], ht[keep]
        step = int(chunk_size or max(hs.shape[0], 1))
        total = 0.0
        for i in range(0, hs.shape[0], step):
            total += float(token_divergence(head_s(hs[i:i + step]), head_t(ht[i:i + step])).sum())
        out.append(total / max(hs.shape[0], 1))
    return out
