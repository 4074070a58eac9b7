"""Expert Condenser protocol: usage tie-breaking, soft usage, n=0, the bias file, option names."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import moe_lab
from moe_lab.methods.condenser import choose_condensers, save_condenser_state
from moe_lab.methods.condenser_module import CondenserModule
from tests.conftest import build_tiny, random_batch

G = 1e-3


def _layer_with(bias, usage, n, sign="sparsify", select="lowest_bias"):
    patch = moe_lab.apply(build_tiny("olmoe"), "condenser", n=n, sign=sign, select=select, selection="in_run", selection_updates=1)
    for layer in patch.layers:
        layer.bias.copy_(torch.tensor(bias) * G)
        layer.usage.copy_(torch.tensor(usage, dtype=torch.float64))
    return patch


# biases (in units of gamma) with ties at the boundary; usage chosen so that index order would pick otherwise
BIAS = [0, -1, -1, 0, -1, 1, 0, 0]
USAGE = [1, 9, 3, 2, 7, 20, 8, 4]


@pytest.mark.parametrize("select,sign,expected", [
    ("lowest_bias", "sparsify", [2, 4]),   # among the -1 ties, the least used (3, 7), not the first ids (1, 2)
    ("lowest_bias", "balance", [1, 4]),    # balance: bias falls with usage, so the most used (9, 7)
    ("highest_bias", "sparsify", [5, 6]),  # 5, then among the 0 ties the most used (6: 8)
    ("most_used", "sparsify", [5, 1]),
    ("least_used", "sparsify", [0, 3]),
])
def test_planted_ties_are_broken_by_usage_never_by_index(select, sign, expected):
    patch = _layer_with(BIAS, USAGE, n=2, sign=sign, select=select)
    chosen = choose_condensers(patch, select, sign)
    assert all(ids == sorted(expected) for ids in chosen.values())


def test_full_ties_fall_back_to_index_with_a_warning(caplog):
    patch = _layer_with([0, -1, -1, 0, -1, 1, 0, 0], [1, 3, 3, 2, 3, 20, 8, 4], n=1)
    with caplog.at_level("WARNING"):
        chosen = choose_condensers(patch, "lowest_bias")
    assert chosen[0] == [1] and "equal bias and usage" in caplog.text


def test_bias_file_condensers_use_its_usage_for_ties(tmp_path):
    source = _layer_with(BIAS, USAGE, n=0)
    path = save_condenser_state(source, tmp_path / "phase1.json")
    saved = json.loads(path.read_text())["layers"]["0"]
    assert saved["usage"] == [float(u) for u in USAGE] and saved["forced_experts"] == []
    patch = moe_lab.apply(build_tiny("olmoe"), "condenser", n=2, bias_file=str(path))
    assert [layer.forced_experts for layer in patch.layers] == [[2, 4], [2, 4]]
    assert not patch.bias_updater.pending, "condensers from a bias file: chosen at once"


def _recorded_inputs(patch):
    inputs = []
    for view in patch.views:
        view.router.register_forward_hook(lambda m, args, out: inputs.append((m, args[0].detach())))
    return inputs


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_soft_usage_is_the_probability_mass_of_real_tokens(family):
    model = build_tiny(family).train()
    patch = moe_lab.apply(model, "condenser", n=0, load="soft", gamma=G)
    inputs = _recorded_inputs(patch)
    batch = random_batch(batch=3, seq=10)
    model(**batch)
    real = batch["attention_mask"].reshape(-1).bool()
    expected = []
    for router, x in inputs:
        logits = F.linear(x.float(), router.weight.float())
        if family == "deepseek_v3":  # normalised sigmoid affinity
            probs = logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True)
        else:
            probs = torch.softmax(logits, -1)
        expected.append(probs[real].double().sum(0))
    for layer, want in zip(patch.layers, expected):
        # float64 sums of 22 fp32 probabilities (< 1 each) in possibly another order
        torch.testing.assert_close(layer.soft_load, want, rtol=0, atol=1e-12)
    soft = torch.stack([layer.soft_load.clone() for layer in patch.layers])
    patch.update_biases()
    for layer, load in zip(patch.layers, soft):
        assert torch.equal(layer.bias, (G * -1.0 * torch.sign(load.mean() - load)).float())
        assert torch.equal(layer.usage, load) and float(layer.soft_load.abs().sum()) == 0.0
    model.eval()
    model(**batch)
    assert float(patch.layers[0].soft_load.sum()) == 0.0, "no usage counted in eval mode"


def test_n_zero_is_bias_only_never_condensers():
    model = build_tiny("olmoe").train()
    patch = moe_lab.apply(model, "condenser", n=0, gamma=G)
    for seed in range(3):
        model(**random_batch(seed=seed))
        patch.update_biases()
    assert all(layer.forced_experts == [] for layer in patch.layers)
    assert patch.layers[0].bias.abs().sum() > 0 and not patch.bias_updater.pending


def test_condenser_module_refuses_other_methods():
    with pytest.raises(ValueError, match="method=condenser"):
        CondenserModule(build_tiny("olmoe"), method="sft")


def test_ablation_presets_compose_with_the_option_names():
    from hydra import compose, initialize_config_dir

    from tests.conftest import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for overrides in (["method.options.n=0"], ["method.options.select=highest_bias"],
                          ["method.options.gamma=0.001"], ["method.options.load=soft"]):
            cfg = compose(config_name="config", overrides=["method=condenser", *overrides])
            key, value = overrides[0].removeprefix("method.options.").split("=")
            assert str(cfg.method.options[key]) == value
            options = {k: v for k, v in cfg.method.options.items()}
            patch = moe_lab.apply(copy.deepcopy(build_tiny("olmoe")), "condenser", **options)
            updater = patch.bias_updater
            assert (updater.gamma, updater.select, updater.load) == (options["gamma"], options["select"],
                                                                     options["load"])
            assert patch.layers[0].forced_expert_ids.numel() == options["n"]


def test_soft_usage_counted_once_under_activation_checkpointing():
    batch = random_batch()
    results = []
    for checkpointing in (False, True):
        model = build_tiny("qwen3_moe").train()
        patch = moe_lab.apply(model, "condenser", n=0, load="soft")
        if checkpointing:
            model.activation_checkpointing_enable()
        model(**batch).loss.backward()
        results.append(torch.stack([layer.soft_load.clone() for layer in patch.layers]))
    assert torch.equal(results[0], results[1]) and results[0].sum() > 0
