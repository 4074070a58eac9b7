"""The Switch load-balancing loss moe-lab computes itself (:func:`moe_lab.moe.aux_loss.switch_balance_loss`): on one
process it is HF's own loss, bit for bit, for every family that uses it; with ``over_ranks`` (``method.aux_loss_scope
=global``) on 2 processes, each holding part of a batch with unequal padding, its value is the single-process loss of
the whole batch and its gradient, averaged over the ranks as DDP averages, is that loss's gradient."""

from __future__ import annotations

import os

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import moe_lab
from moe_lab.moe.aux_loss import switch_balance_loss
from moe_lab.moe.registry import FAMILIES
from tests.conftest import build_tiny, random_batch, run_ranks

SWITCH = sorted(name for name, spec in FAMILIES.items() if spec.aux_loss in ("hf", "switch"))
BATCH = {"batch": 4, "seq": 10, "pad_rows": ((0, 1), (1, 7), (3, 2))}  # rank 0 (rows 0-1) has fewer real tokens


def _routed(family: str, batch: dict):
    model = build_tiny(family, output_router_logits=True).eval()
    patch = moe_lab.apply(model, "sft")
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return model, patch, out


@pytest.mark.parametrize("family", SWITCH)
def test_one_process_equals_hf_bit_for_bit(family):
    batch = random_batch(**BATCH)
    try:
        model, patch, out = _routed(family, batch)
    except ValueError as err:  # a family the tiny builder cannot make
        pytest.skip(str(err))
    layer = patch.layers[0]
    mine = switch_balance_loss(out.router_logits, layer.num_experts, layer.top_k, batch["attention_mask"])
    # HF's own: the model's aux_loss where HF computes it, else Mixtral's function that moe-lab's "switch" mirrors
    hf = out.aux_loss if FAMILIES[model.config.model_type].aux_loss == "hf" else \
        load_balancing_loss_func(out.router_logits, layer.num_experts, layer.top_k, batch["attention_mask"])
    assert torch.equal(mine, hf), (float(mine), float(hf))
    unmasked = load_balancing_loss_func(out.router_logits, layer.num_experts, layer.top_k, None)
    assert torch.equal(switch_balance_loss(out.router_logits, layer.num_experts, layer.top_k), unmasked)


def _ranks(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    model = build_tiny("olmoe", output_router_logits=True)
    patch = moe_lab.apply(model, "sft")
    batch = random_batch(**BATCH)
    mine = {k: v[2 * rank:2 * rank + 2] for k, v in batch.items()}
    logits = model(input_ids=mine["input_ids"], attention_mask=mine["attention_mask"]).router_logits
    layer = patch.layers[0]
    loss = switch_balance_loss(logits, layer.num_experts, layer.top_k, mine["attention_mask"], over_ranks=True)
    local = switch_balance_loss(logits, layer.num_experts, layer.top_k, mine["attention_mask"])
    loss.backward()
    grads = {n: p.grad / 2 for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():  # DDP's average
        torch.distributed.all_reduce(g)
    if rank == 0:
        torch.save({"loss": loss.detach(), "local": local.detach(), "grads": grads}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_over_ranks_is_the_single_process_loss_of_the_whole_batch(tmp_path):
    out = tmp_path / "rank0.pt"
    run_ranks(_ranks, 2, str(out))
    got = torch.load(out)
    model = build_tiny("olmoe", output_router_logits=True)
    patch = moe_lab.apply(model, "sft")
    batch = random_batch(**BATCH)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).router_logits
    layer = patch.layers[0]
    whole = switch_balance_loss(logits, layer.num_experts, layer.top_k, batch["attention_mask"])
    whole.backward()
    # the value: one sum of float32 counts and probabilities in another order (2 ranks), a few ulps
    assert float(got["loss"]) == pytest.approx(float(whole), rel=1e-6)
    assert abs(float(got["local"]) - float(whole)) > 1e-4  # rank 0's own tokens alone give another loss
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got["grads"]) == set(expected) and any(n.endswith("gate.weight") for n in expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
