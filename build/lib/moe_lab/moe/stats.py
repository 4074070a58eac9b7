"""Routing-statistics context shared by the moe-lab blocks of one patched model.

Counts are taken only for real (non-pad) tokens, only while the block trains or an explicit
calibration context is open, and never during autograd's backward pass (activation-checkpoint
recomputation), so each token is counted once.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def in_backward_pass() -> bool:
    """True while autograd runs a backward graph (e.g. recomputing a checkpointed layer)."""
    return torch._C._current_graph_task_id() != -1


class TokenContext:
    """Holds the current forward's attention mask and the calibration flag for all blocks."""

    def __init__(self):
        self.attention_mask: torch.Tensor | None = None
        self.calibrating = False
        self.fallback_mask: torch.Tensor | None = None

    def capture(self, module, args, kwargs):
        """Forward pre-hook on the patched model: remember the attention mask of this call (or, when the
        call has none, e.g. a packed batch, the mask given to :meth:`real_tokens`)."""
        mask = kwargs.get("attention_mask")
        self.attention_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else self.fallback_mask

    @contextmanager
    def real_tokens(self, mask: torch.Tensor | None):
        """Count only tokens where ``mask`` [batch, seq] is 1 for calls that pass no attention mask."""
        previous, self.fallback_mask = self.fallback_mask, mask
        try:
            yield
        finally:
            self.fallback_mask = previous

    def release(self, module, args, kwargs, output):
        """Forward hook: forget the mask once the model call returns."""
        self.attention_mask = None

    def token_mask(self, batch: int, seq: int) -> torch.Tensor | None:
        """Flat bool mask [batch*seq] of real tokens for a block input of that shape, or None (all real)."""
        mask = self.attention_mask
        if mask is None or mask.shape[0] != batch or mask.shape[1] < seq:
            return None
        return mask[:, -seq:].reshape(-1).bool()

    @contextmanager
    def calibration(self):
        """Count routing statistics even in eval mode."""
        previous, self.calibrating = self.calibrating, True
        try:
            yield
        finally:
            self.calibrating = previous


def bincount_experts(indices: torch.Tensor, mask: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """int64 [num_experts] count of (token, slot) assignments, pad tokens excluded."""
    if mask is not None:
        indices = indices[mask]
    return torch.bincount(indices.reshape(-1), minlength=num_experts)[:num_experts]
