"""Expert parallelism (``moe_lab.runtime.expert_parallel``) on 2 and 4 CPU processes over gloo equals the
single-process run of the same global batch.

Each rank holds ``E / ep_size`` experts and its share of the batch; transformers' ``AllToAllEP`` carries the
(token, expert) pairs to the experts' owners and back, DDP averages the dense gradients, and the experts' gradients
are summed over the data-parallel replicas and divided by the world size. The reference trains the unsharded
model on the mean of the ranks' losses. Tolerance from the arithmetic, as tests/runtime/test_sharded_densemixer.py:
the only change is the order of float32 sums (the ranks' gradients averaged as g1/W + g2/W, the experts' outputs of
a token summed after the all-to-all), and SGD keeps that rounding from being amplified: first loss to 1e-6, every
gathered parameter to 1e-6 absolute.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import moe_lab
from tests.conftest import build_tiny, free_port, random_batch, run_ranks

pytestmark = pytest.mark.slow

BATCH, STEPS, LR, CLIP = 4, 3, 5e-2, 0.5
#: condenser: biases from the loads of every rank's tokens, condensers chosen after the second update, in the run;
#: densemixer_dense: the paper's ablation (dense forward, conventional gradient)
#: sft_lora / densemixer_lora: LoRA on every linear target, experts included (each rank adapts its own experts);
#: esft: a selection installed before EP shards the experts (layer 1: all of EP rank 0's experts, none of rank 1's);
#: esft_scored: ESFT-Token's selection scored under EP on every rank's tokens, installed on the sharded experts
OPTIONS = {"condenser": {"gamma": 1e-2, "n": 1, "selection": "in_run", "selection_updates": 2},
           "densemixer_dense": {"forward": "dense", "gradient": "conventional"},
           "esft": {"experts": {0: [1, 2, 6], 1: [0, 1, 2, 3]}}, "esft_scored": {"experts": {}},
           "sft_lora": {"lora": {"rank": 4, "alpha": 8.0}}, "densemixer_lora": {"lora": {"rank": 4, "alpha": 8.0}}}
ESFT_P = 0.3
AUX = 0.1  # sft_aux: sft with the Switch loss over every rank's tokens (method.aux_loss_scope=global) at this weight
#: (family, method, ep_size) per world size: one group of processes runs each world's cases in turn
CASES = {
    2: [("qwen3_moe", "sft_aux", 2), ("qwen3_moe", "condenser", 2), ("qwen3_moe", "densemixer", 2),
        ("olmoe", "densemixer_dense", 2), ("olmoe", "esft", 2), ("qwen3_moe", "esft_scored", 2),
        ("qwen3_moe", "compressed_experts", 2), ("qwen3_moe", "sft_lora", 2), ("olmoe", "densemixer_lora", 2)],
    4: [("qwen3_moe", "frozen_router", 2), ("olmoe", "sft", 4), ("olmoe", "densemixer", 4),
        ("olmoe", "esft_scored", 4)],
}


#: the cases' variants of a method
VARIANT_OF = {"sft_aux": "sft", "sft_lora": "sft", "esft_scored": "esft", "densemixer_dense": "densemixer",
              "densemixer_lora": "densemixer"}


def _install(model, method: str):
    return moe_lab.apply(model, VARIANT_OF.get(method, method), **OPTIONS.get(method, {}))


def _model(family: str, method: str):
    """The tiny model; sft_aux records its router logits (HF's own aux term in ``loss`` weighted 0)."""
    aux = {"output_router_logits": True, "router_aux_loss_coef": 0.0} if method == "sft_aux" else \
        {"output_router_logits": False}
    return build_tiny(family, **aux).train()


def _aux(patch, out, batch: dict, over_ranks: bool):
    from moe_lab.moe.aux_loss import switch_balance_loss

    layer = patch.layers[0]
    return AUX * switch_balance_loss(out.router_logits, layer.num_experts, layer.top_k, batch["attention_mask"],
                                     over_ranks=over_ranks)


def _esft_select(patch, model, batch, reduce=None) -> dict:
    """esft_scored: ESFT-Token's selection from the routing statistics of ``batch`` (summed over the ranks by
    ``reduce``), installed on the patch (sharded experts or not)."""
    from moe_lab.methods.esft import esft_select, esft_statistics, select_experts

    stats = esft_statistics(model, [batch])
    if reduce is not None:
        stats.unpack(reduce(stats.packed()))
    selection = esft_select(stats.scores(), ESFT_P, score="token")
    select_experts(patch, selection)
    return selection


def _batch():
    return random_batch(batch=BATCH, seq=8, pad_rows=())  # every rank averages over the same token count


def _share(batch: dict, rank: int, world: int) -> dict:
    n = BATCH // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def _forced(patch) -> list[list[int]]:
    """Each layer's condensers (experts forced into every token's set; empty for other methods)."""
    return [block.forced_experts for block in patch.layers]


def _ep_runs(rank: int, port: int, world: int, out: str) -> None:
    """One rank: every case of ``world`` in turn, each trained STEPS SGD steps on the rank's share under EP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from moe_lab.runtime import expert_parallel

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for family, method, ep_size in CASES[world]:
        model = _model(family, method)
        patch = _install(model, method)
        ep = expert_parallel.install(patch, ep_size)
        mine, losses, selection = _share(_batch(), rank, world), [], None
        if method == "esft_scored":
            selection = _esft_select(patch, model, mine, reduce=lambda t: torch.distributed.all_reduce(t) or t)
        DDP._set_params_and_buffers_to_ignore_for_model(model, ep.parameter_names(model))
        wrapped = DDP(model) if expert_parallel.dense_part_trains(model) else model  # ESFT: only experts train
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        for _ in range(STEPS):
            output = wrapped(**mine)
            loss = output.loss + _aux(patch, output, mine, over_ranks=True) if method == "sft_aux" else output.loss
            losses.append(loss.item())
            loss.backward()
            ep.sync_gradients()
            ep.clip_gradients(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            patch.after_optimizer_step()
        state = model.state_dict()  # a collective: every rank gathers the experts
        results[(family, method, ep_size)] = {"losses": losses, "state": state, "forced": _forced(patch),
                                              "selection": selection}
    if rank == 0:
        torch.save(results, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _reference(base, method: str, world: int):
    model = copy.deepcopy(base)
    patch = _install(model, method)
    batch, first = _batch(), None
    selection = _esft_select(patch, model, batch) if method == "esft_scored" else None
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for _ in range(STEPS):
        shares = [model(**_share(batch, r, world)).loss for r in range(world)]
        loss = sum(shares) / world
        if method == "sft_aux":  # the Switch loss of the whole batch: every rank's tokens at once
            loss = loss + _aux(patch, model(**batch), batch, over_ranks=False)
            if first is None:
                first = shares[0].item() + _aux(patch, model(**batch), batch, over_ranks=False).item()
        first = shares[0].item() if first is None else first
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], CLIP)
        opt.step()
        opt.zero_grad()
        patch.after_optimizer_step()
    return model, first, _forced(patch), selection


@pytest.mark.parametrize("world", sorted(CASES))
def test_expert_parallel_runs_equal_the_single_process_runs(world, tmp_path):
    out = tmp_path / "rank0.pt"
    run_ranks(_ep_runs, world, world, str(out))
    results = torch.load(out)
    for family, method, ep_size in CASES[world]:
        case = f"{family} {method} EP{ep_size} of {world}"
        base = _model(family, method)
        reference, first, forced, selection = _reference(base, method, world)
        got = results[(family, method, ep_size)]
        assert got["losses"][0] == pytest.approx(first, rel=1e-6, abs=1e-6), case  # rank 0's share, before a step
        assert got["forced"] == forced and (method != "condenser" or all(forced)), case
        assert got["selection"] == selection, case  # ESFT: scored on every rank's tokens
        if method == "esft_scored":
            assert 0 < sum(map(len, selection.values())) < 8 * len(selection), case  # a strict subset trains
        expected = reference.state_dict()
        assert set(got["state"]) == set(expected), case
        moved, before = 0, base.state_dict()
        for name, value in got["state"].items():
            assert value.shape == expected[name].shape, f"{case} {name}"
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6,
                                       msg=lambda m, name=name, case=case: f"{case} {name}: {m}")
            moved += name in before and value.is_floating_point() and not torch.equal(value, before[name])
        assert moved > 0, case
        if method.startswith("esft"):  # the frozen experts' slices are bit-identical to the start
            chosen = selection or OPTIONS[method]["experts"]
            for name, value in got["state"].items():
                layer = next((int(n) for n in name.split(".") if n.isdigit()), None)
                if name.endswith(("gate_up_proj", "down_proj")) and layer in chosen:
                    frozen = [e for e in range(value.shape[0]) if e not in chosen[layer]]
                    assert torch.equal(value[frozen], before[name][frozen]), f"{case} {name}"
        if method.startswith("densemixer"):  # the router trained: every expert's output reached its gradient
            routers = [n for n in expected if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
            assert routers and all(not torch.equal(got["state"][n], before[n]) for n in routers), case


@pytest.mark.parametrize("family", ["dbrx", "llama4_text"])
def test_families_without_a_packed_experts_call_are_refused(family):
    """DBRX stores experts as row blocks, Llama 4 weights the expert input: no (tokens, ids, weights) call to
    dispatch. A one-process group is enough to reach the check."""
    from moe_lab.runtime import expert_parallel

    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        patch = moe_lab.apply(build_tiny(family), "sft")
        with pytest.raises(ValueError, match=rf"hardware.ep_size=1: {patch.spec.model_type}'s experts .*not "
                                             r"transformers' packed experts"):
            expert_parallel.install(patch, 1)
    finally:
        torch.distributed.destroy_process_group()
