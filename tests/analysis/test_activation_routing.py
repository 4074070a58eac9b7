"""task=activation_stats counts what the trained model does: an export is counted under the routing it carries
(Expert Condenser: biases and forced condensers; Compressed Experts: main experts), checked against an independent
float64 count: each MoE block's input captured from the installed model, routed by hand (router weight, bias,
forced set / k_main) and counted over the real tokens. A vanilla copy of the same weights counts otherwise."""

from __future__ import annotations

import csv
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import moe_lab
from moe_lab.methods.registry import install_exported_routing
from moe_lab.models import load_model
from moe_lab.runs.calibrate import calibration_sequences
from moe_lab.tasks import run_task
from tests.conftest import ROOT, build_tiny

FORCED = {0: [3], 2: [6]}  # tiny_qwen2_moe: MoE layers 0 and 2 (layer 1 is dense), 8 experts, top-2


def _cfg(tmp_path, runs: dict, name: str = "run"):
    overrides = ["task=activation_stats", "model=tiny_qwen2_moe", "dataset@task.dataset=synthetic_math",
                 "task.calibration.num_sequences=6", "task.dataset.num_examples=40",
                 f"paths.output_dir={tmp_path / name}", "logger=none"]
    overrides += [f"+task.runs.{k}={v}" for k, v in runs.items()]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def _export(tmp_path, method: str, **options):
    model = build_tiny("qwen2_moe")
    patch = moe_lab.apply(model, method, **options)
    if method == "condenser":
        gen = torch.Generator().manual_seed(7)
        for layer in patch.layers:  # trained biases: large enough to change the free slot of many tokens
            layer.bias.copy_(torch.randn(layer.num_experts, generator=gen) * 2)
    return patch.export(tmp_path / method / "export")


def _read(path) -> dict[str, dict[int, list[int]]]:
    out: dict[str, dict[int, list[int]]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            out.setdefault(row["run"], {}).setdefault(int(row["layer"]), []).append(int(row["selections"]))
    return out


def _hand_counts(export, cfg, choose) -> dict[int, list[int]]:
    """Load ``export`` with its routing, capture every MoE block's input on the task's batches and count the
    experts ``choose(logits64, block)`` picks per real token."""
    model, tokenizer = load_model({"pretrained": str(export), "tokenizer": "byte"})
    patch = install_exported_routing(model, export) or moe_lab.apply(model, "sft")  # plain: to hook its blocks
    inputs: dict[int, list[torch.Tensor]] = {layer.index: [] for layer in patch.layers}
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=layer.index: inputs[i].append(a[0].detach()))
             for layer in patch.layers]
    batches, _ = calibration_sequences(cfg.task.dataset, tokenizer, cfg.task.calibration)
    masks = []
    model.eval()
    with torch.no_grad():
        for b in batches:
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
            masks.append(b["attention_mask"].reshape(-1).bool())
    for h in hooks:
        h.remove()
    counts = {}
    for layer in patch.layers:
        weight = layer.view.obj.router_weight.detach().double()
        total = torch.zeros(layer.num_experts, dtype=torch.long)
        for x, mask in zip(inputs[layer.index], masks):
            logits = x.reshape(-1, x.shape[-1]).double() @ weight.T
            chosen = choose(logits[mask], layer)
            total += torch.bincount(chosen.reshape(-1), minlength=layer.num_experts)
        counts[layer.index] = total.tolist()
    return counts


def _condenser_choice(logits, layer):
    """Forced condensers in every set; the k - n free slots: top by logit + bias among the other experts."""
    forced = FORCED[layer.index]
    scores = logits + layer.bias.double()
    scores[:, forced] = float("-inf")
    free = scores.topk(layer.top_k - len(forced), dim=-1).indices
    return torch.cat([torch.tensor(forced).expand(len(logits), -1), free], dim=1)


def test_condenser_export_is_counted_under_its_routing(tmp_path):
    export = _export(tmp_path, "condenser", n=1, experts=FORCED)
    vanilla = tmp_path / "vanilla" / "export"
    shutil.copytree(export, vanilla)
    (vanilla / "condenser.json").unlink()
    cfg = _cfg(tmp_path, {"condenser": export, "vanilla": vanilla})
    run_task(cfg)
    got = _read(tmp_path / "run" / "activation_counts.csv")
    expected = _hand_counts(export, cfg, _condenser_choice)
    assert got["condenser"] == expected
    tokens = sum(expected[0]) // 2
    for layer, ids in FORCED.items():  # a condenser every token uses shows every token
        assert got["condenser"][layer][ids[0]] == tokens
    plain = _hand_counts(vanilla, cfg, lambda logits, layer: logits.topk(layer.top_k, dim=-1).indices)
    assert got["vanilla"] == plain and plain != expected
    assert "forced experts {0: [3], 2: [6]}" in (tmp_path / "run" / "activation.md").read_text()


def test_compressed_experts_export_counts_main_experts(tmp_path):
    export = _export(tmp_path, "compressed_experts", k_main=1)
    cfg = _cfg(tmp_path, {})
    cfg.model.pretrained = str(export)  # no task.runs: the model itself, with the routing it carries
    run_task(cfg)
    got = _read(tmp_path / "run" / "activation_counts.csv")["tiny_qwen2_moe"]
    # softmax router: the largest router weight is the largest logit
    assert got == _hand_counts(export, cfg, lambda logits, layer: logits.argmax(-1, keepdim=True))


def test_refusals(tmp_path):
    cfg = _cfg(tmp_path, {"x": tmp_path / "missing"})
    with pytest.raises(FileNotFoundError, match=r"task.runs.x=.*does not exist: give an export directory"):
        run_task(cfg)


def test_a_densemixer_export_given_as_the_model_counts_every_expert(tmp_path, capsys):
    """A DenseMixer run's export passed as model.pretrained (no task.runs): every expert is active on every real
    token (the run's config.yaml says method.name=densemixer); it was counted as sparse top-k before."""
    export = _export(tmp_path, "densemixer")
    OmegaConf.save({"method": {"name": "densemixer"}}, export.parent / "config.yaml")
    cfg = _cfg(tmp_path, {})
    cfg.model.pretrained = str(export)
    run_task(cfg)
    assert f"activation_stats: model.pretrained={export} was trained with method=densemixer" in capsys.readouterr().out
    got = _read(tmp_path / "run" / "activation_counts.csv")["tiny_qwen2_moe"]
    sparse = _hand_counts(export, cfg, lambda logits, layer: logits.topk(layer.top_k, dim=-1).indices)
    tokens = sum(sparse[next(iter(sparse))]) // build_tiny("qwen2_moe").config.num_experts_per_tok
    assert all(counts == [tokens] * len(counts) for counts in got.values())
