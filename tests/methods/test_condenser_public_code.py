"""``method=condenser_public_code`` against a small independent re-implementation of the authors' public code
(HectorHHZ/ExpertCondenser, its OLMoE patch ``AuxFreeOlmoeSparseMoeBlock`` and trainer hook), re-written here
from its description, not imported: the bias inside the softmax; top-k over ALL experts, then the condensers
appended (a condenser in the top-k runs twice); soft usage = the biased softmax summed over every token, pads
included; after every micro-batch every bias (condensers' too) moves by gamma toward usage above the mean over
all experts; condensers = ``torch.topk(bias, n, largest=False)`` of the loaded biases."""

from __future__ import annotations

import copy

import lightning as L
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

import moe_lab
from moe_lab.methods.condenser import PUBLIC_CODE, save_condenser_state
from moe_lab.methods.condenser_module import CondenserModule
from tests.conftest import ROOT, build_tiny, random_batch


def _public_block(block, state, x):
    """The public code's MoE block on ``x`` [B, S, H] with ``state`` {bias, forced, usage}; experts computed by hand
    from the packed HF tensors (gate_up [E, 2I, H], down [E, H, I]), one slot at a time."""
    b, s, h = x.shape
    flat = x.reshape(-1, h)
    logits = F.linear(flat, block.gate.weight) + state["bias"]
    probs = torch.softmax(logits, dim=1, dtype=torch.float)
    weights, chosen = torch.topk(probs, block.gate.top_k, dim=-1)
    forced = state["forced"]
    weights = torch.cat([weights, probs[:, forced]], dim=-1)
    chosen = torch.cat([chosen, forced.expand(flat.shape[0], -1)], dim=-1)
    state["duplicates"] += int((chosen[:, :-len(forced), None] == forced).any(-1).any(-1).sum())
    out = torch.zeros_like(flat)
    for slot in range(chosen.shape[1]):
        e = chosen[:, slot]
        gate, up = torch.einsum("nih,nh->ni", block.experts.gate_up_proj[e], flat).chunk(2, dim=-1)
        y = torch.einsum("nhi,ni->nh", block.experts.down_proj[e], F.silu(gate) * up)
        out = out + y * weights[:, slot, None].to(flat.dtype)
    state["usage"] = probs.sum(dim=0)
    return out.reshape(b, s, h)


def _public_update(state, gamma):
    usage = state["usage"]
    step = torch.zeros_like(state["bias"])
    step[usage > usage.mean()] = gamma
    step[usage < usage.mean()] = -gamma
    state["bias"] = state["bias"] + step


def test_public_code_protocol_matches_an_independent_reimplementation(tmp_path):
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["method=condenser_public_code"])
    options = OmegaConf.to_container(cfg.method.options)
    assert {k: options[k] for k in PUBLIC_CODE} == PUBLIC_CODE and cfg.method.method == "condenser"
    gamma, n = options["gamma"], 2
    vanilla = build_tiny("olmoe")
    assert not vanilla.config.norm_topk_prob and vanilla.config.hidden_act == "silu"
    oracle = copy.deepcopy(vanilla).train()
    # a phase-1 bias file: distinct biases, small beside the logits so condensers often sit in the top-k too
    source = moe_lab.apply(copy.deepcopy(vanilla), "condenser", n=0)
    gen = torch.Generator().manual_seed(5)
    for layer in source.layers:
        layer.bias.copy_(torch.randn(layer.num_experts, generator=gen) * 1e-3)
    bias_file = save_condenser_state(source, tmp_path / "phase1.json")

    states = []
    for layer, src in zip(oracle.model.layers, source.layers):
        bias = src.bias.clone()
        state = {"bias": bias, "forced": torch.topk(bias, n, largest=False).indices, "duplicates": 0}
        layer.mlp.forward = lambda x, block=layer.mlp, st=state: _public_block(block, st, x)
        states.append(state)

    data = [random_batch(batch=3, seq=10, seed=20 + i) for i in range(4)]  # rows 1, 2 left-padded
    module = CondenserModule(vanilla, "condenser", options={**options, "n": n, "bias_file": str(bias_file)},
                             optim={"lr": 0.0})
    assert [sorted(s["forced"].tolist()) for s in states] == [layer.forced_experts for layer in module.patch.layers]
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append([layer.bias.clone() for layer in pl_module.patch.layers])

    trainer = L.Trainer(max_steps=2, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        default_root_dir=tmp_path, callbacks=[Record()], num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data, batch_size=None))
    seen.append([layer.bias.clone() for layer in module.patch.layers])
    assert len(seen) == 5 and trainer.global_step == 2
    for m in range(5):  # before micro-batch m (= after m updates, one per micro-batch), then after the last
        for ours, state in zip(seen[m], states):
            torch.testing.assert_close(ours, state["bias"], rtol=0, atol=1e-7)
        if m < 4:
            with torch.no_grad():
                oracle(**data[m])
            for state in states:
                _public_update(state, gamma)
    assert all(s["duplicates"] > 0 for s in states), "some tokens had a condenser in their top-k as well"
    for i in range(len(states)):  # one update moves EVERY bias by gamma, the condensers' included
        moved = (seen[1][i] - seen[0][i]).abs().double()
        torch.testing.assert_close(moved, torch.full_like(moved, gamma), rtol=0, atol=1e-9)
    batch = random_batch(batch=2, seq=9, seed=99)
    module.model.eval()
    oracle.eval()
    with torch.no_grad():
        torch.testing.assert_close(module.model(**batch).logits, oracle(**batch).logits, rtol=1e-5, atol=1e-6)
