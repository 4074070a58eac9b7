"""Knowledge distillation: token-level losses (:func:`kd_loss`), chunked lm-head KD, the frozen teacher with
widened routing; the Lightning objective is ``moe_lab.methods.distill.KDModule`` (method=kd)."""

from .losses import KINDS, chunked_head_kd, hidden_mse_sum, kd_loss, token_divergence
from .teacher import WidenedRouting, load_teacher, widen_teacher

__all__ = [
           "KINDS",
           "WidenedRouting",
           "chunked_head_kd",
           "hidden_mse_sum",
           "kd_loss",
           "load_teacher",
           "token_divergence",
           "widen_teacher",
]
