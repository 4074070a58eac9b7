"""Precomputed teacher logits (for hardware where teacher and student cannot share one engine).

``record_teacher(teacher, batches, top_k=None)`` runs the teacher once and keeps, for every real token in batch
order, either the full logits (``top_k=None``) or the top-k logits with their indices and the log-sum-exp of
the full row; ``save``/``load`` write one safetensors file. ``kd_loss_from_record`` is KD against such a record:
exact for full logits (any kind); for top-k (forward KL only) the teacher distribution is truncated to its k
largest probabilities p_T(v) = exp(z_v - lse), true values, the tail mass 1 - sum dropped:
sum_{v in top-k} p_T(v) (log p_T(v) - log p_S(v)), which equals the full forward KL when the tail mass is 0
and otherwise differs from it by the tail's contribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from .losses import _mask, token_divergence


@torch.no_grad()
def record_teacher(teacher, batches, top_k: int | None = None) -> dict[str, torch.Tensor]:
    """Teacher logits of the real tokens of ``batches`` (padded: input_ids + attention_mask; packed: as
    ``data.packing.model_inputs`` reads them, the teacher seeing what method=kd gives it), in order."""
    from ..data.packing import model_inputs, real_token_mask

    device = next(teacher.parameters()).device
    rows = []
    for batch in batches:
        mask = real_token_mask(batch).bool().to(device)
        inputs = model_inputs({"labels": None, **batch})
        inputs.pop("labels")
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        rows.append(teacher(**inputs).logits.float()[mask].cpu())
    logits = torch.cat(rows)
    if top_k is None:
        return {"logits": logits}
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"teacher_logits top_k={top_k} must be between 1 and the vocabulary {logits.shape[-1]}")
    values, indices = logits.topk(top_k, dim=-1)
    return {"values": values, "indices": indices, "lse": torch.logsumexp(logits, dim=-1)}


def save(record: dict[str, torch.Tensor], path) -> None:
    save_file({k: v.contiguous() for k, v in record.items()}, str(path))


def load(path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def kd_loss_from_record(student_logits: torch.Tensor, record: dict[str, torch.Tensor], kind: str = "forward_kl",
                        temperature: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean KD over the real tokens of ``student_logits`` against a teacher record of the same tokens."""
    s = student_logits.reshape(-1, student_logits.shape[-1])
    s = s[_mask(mask, s.shape[0], s.device)]
    if "logits" in record:
        t = record["logits"].to(s.device)
        if t.shape != s.shape:
            raise ValueError(f"teacher record holds {tuple(t.shape)} logits for {tuple(s.shape)} student tokens")
        return token_divergence(s, t, kind, temperature).mean()
    if kind != "forward_kl" or temperature != 1.0:
        raise ValueError("a top-k teacher record supports forward_kl at temperature 1 only (record full logits)")
    values, indices, lse = (record[k].to(s.device) for k in ("values", "indices", "lse"))
    if values.shape[0] != s.shape[0]:
        raise ValueError(f"teacher record holds {values.shape[0]} tokens, the student batch {s.shape[0]}")
    log_p_t = values - lse[:, None]
    log_p_s = F.log_softmax(s.float(), dim=-1).gather(1, indices)
    return (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1).mean()
