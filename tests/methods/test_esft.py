"""ESFT: scores against a hand computation from HF's own routers, selection by hand cases, frozen groups
and expert slices bit-identical after training, JSON round trip, selection at fit start, run.py."""

from __future__ import annotations

import copy
import json
import math

import lightning as L
import pytest
import torch
import transformers
from torch.utils.data import DataLoader

import moe_lab
from moe_lab.methods.base import MoELightningModule
from moe_lab.methods.esft import esft_parameter_groups, load_selection, save_selection
from moe_lab.methods.esft_module import ARTIFACT, CHECKPOINT_KEY, ESFTLightningModule
from moe_lab.moe.block import MoEBlock
from moe_lab.moe.view import find_moe_layers
from tests.conftest import ROOT, build_tiny, random_batch
from tests.test_run import run_py


# scores -------------------------------------------------------------------------------------------
def _padded_batches():
    """Two batches with left padding, one row fully padded (it must not count as a sequence)."""
    first = random_batch(batch=3, seq=10, seed=0, pad_rows=((1, 3), (2, 5)))
    second = random_batch(batch=2, seq=7, seed=1, pad_rows=((0, 7), (1, 2)))
    return [first, second]


def _hand_scores(model, batches, scaling: float, per_sequence: bool = True):
    """Scores from the routing HF's own (unpatched) routers return, with plain Python loops."""
    views = find_moe_layers(model)
    captured = {}
    for view in views:
        view.router.register_forward_hook(
            lambda m, a, out, i=view.index: captured.__setitem__(i, (out[1].double(), out[2])))
    sums = {v.index: {"gate": [0.0] * v.num_experts, "token": [0.0] * v.num_experts} for v in views}
    n_sequences = n_tokens = 0
    model.eval()
    for batch in batches:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        bsz, seq = batch["input_ids"].shape
        for b in range(bsz):
            real = [t for t in range(seq) if batch["attention_mask"][b, t] == 1]
            if not real:
                continue
            n_sequences += 1
            n_tokens += len(real)
            for view in views:
                weights, indices = captured[view.index]
                k = indices.shape[1]
                gate, token = [0.0] * view.num_experts, [0.0] * view.num_experts
                for t in real:
                    for slot in range(k):
                        e = int(indices[b * seq + t, slot])
                        gate[e] += float(weights[b * seq + t, slot]) / scaling
                        token[e] += 1.0 / k
                div = len(real) if per_sequence else 1
                for e in range(view.num_experts):
                    sums[view.index]["gate"][e] += gate[e] / div
                    sums[view.index]["token"][e] += token[e] / div
    total = n_sequences if per_sequence else n_tokens
    return {i: {name: torch.tensor(v, dtype=torch.float64) / total for name, v in entry.items()}
            for i, entry in sums.items()}


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_scores_match_a_hand_computation_from_hf_routers(family):
    model = build_tiny(family)
    scaling = float(getattr(model.config, "routed_scaling_factor", 1.0) or 1.0)
    expected = _hand_scores(copy.deepcopy(model), _padded_batches(), scaling)
    got = moe_lab.esft_scores(model, _padded_batches())
    assert not any(isinstance(m, MoEBlock) for m in model.modules()), "the temporary patch must be removed"
    assert model.training, "the model's mode is restored"
    assert sorted(got) == sorted(expected)
    for layer in expected:
        for name in ("gate", "token"):
            assert got[layer][name].dtype == torch.float64
            torch.testing.assert_close(got[layer][name], expected[layer][name], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got[layer]["token"].sum(), torch.tensor(1.0, dtype=torch.float64))


def test_token_average_and_patched_models():
    model = build_tiny("olmoe")
    pooled = _hand_scores(copy.deepcopy(model), _padded_batches(), 1.0, per_sequence=False)
    got = moe_lab.esft_scores(model, _padded_batches(), average="token")
    for layer in pooled:
        for name in ("gate", "token"):
            torch.testing.assert_close(got[layer][name], pooled[layer][name], rtol=1e-9, atol=1e-12)
    unpatched = moe_lab.esft_scores(model, _padded_batches())
    patch = moe_lab.apply(model, "sft")
    patched = moe_lab.esft_scores(model, _padded_batches())
    assert all(torch.equal(patched[i][n], unpatched[i][n]) for i in patched for n in ("gate", "token"))
    assert int(patch.counts().sum()) == 0, "scoring is not training: routing counts stay untouched"
    first_only = moe_lab.esft_scores(model, _padded_batches(), max_batches=1)
    assert not torch.equal(first_only[patch.layers[0].index]["token"], patched[patch.layers[0].index]["token"])


def test_bad_batches_name_the_problem():
    model = build_tiny("olmoe")
    with pytest.raises(ValueError, match="batch 0: expected a dict with 'input_ids'"):
        moe_lab.esft_scores(model, [torch.zeros(2, 3, dtype=torch.long)])
    with pytest.raises(ValueError, match="at least one sequence"):
        moe_lab.esft_scores(model, [{"input_ids": torch.ones(1, 4, dtype=torch.long),
                                     "attention_mask": torch.zeros(1, 4, dtype=torch.long)}])


# selection ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("values,p,expected", [
    ([0.1, 0.4, 0.2, 0.3], 0.5, [1, 3]),  # 0.4 < 0.5, then 0.7: the crossing expert is included
    ([0.1, 0.4, 0.2, 0.3], 0.4, [1]),  # reaching p exactly stops
    ([0.1, 0.4, 0.2, 0.3], 0.41, [1, 3]),
    ([0.1, 0.4, 0.2, 0.3], 1.0, [0, 1, 2, 3]),
    ([0.25, 0.25, 0.25, 0.25], 0.3, [0, 1]),  # ties: lower expert id first
    ([0.0, 0.5, 0.0, 0.25], 0.9, [0, 1, 2, 3]),  # total 0.75 < p: every expert, zero scores included
    ([0.7, 0.2, 0.1], 0.9, [0, 1]),  # 0.7 + 0.2 = 0.8999999999999999 reaches 0.9 within 1e-9
    ([0.0, 0.0, 0.0], 0.1, [0, 1, 2]),
])
def test_select_hand_cases(values, p, expected):
    scores = {3: {"token": torch.tensor(values, dtype=torch.float64), "gate": torch.zeros(len(values))}}
    assert moe_lab.esft_select(scores, p) == {3: expected}


def test_select_gate_normalize_and_json_form():
    scores = {"1": {"gate": [0.2, 0.1, 0.1, 0.0], "token": [0.25] * 4}, "2": {"gate": [0.0, 0.05, 0.3, 0.05],
                                                                          "token": [0.25] * 4}}
    assert moe_lab.esft_select(scores, 0.25, score="gate") == {1: [0, 1], 2: [2]}
    # normalised per layer: layer 1 -> [0.5, 0.25, 0.25, 0], layer 2 -> [0, 0.125, 0.75, 0.125]
    assert moe_lab.esft_select(scores, 0.6, score="gate", normalize=True) == {1: [0, 1], 2: [2]}
    assert moe_lab.esft_select(scores, 0.8, score="gate", normalize=True) == {1: [0, 1, 2], 2: [1, 2]}
    with pytest.raises(ValueError, match="p=0"):
        moe_lab.esft_select(scores, 0)
    with pytest.raises(ValueError, match="score='both'"):
        moe_lab.esft_select(scores, 0.1, score="both")
    with pytest.raises(ValueError, match=r"scores\['1'\]\['gate'\] must be finite"):
        moe_lab.esft_select({"1": {"gate": [float("nan")]}}, 0.1, score="gate")


# installation and training --------------------------------------------------------------------------
def _train(module, steps=5):
    batches = [random_batch(batch=4, seq=12, seed=s) for s in range(steps)]
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return trainer


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek_v2", pytest.param("dbrx", marks=pytest.mark.slow)])
def test_only_selected_expert_slices_change(family):
    """5 Lightning AdamW steps (weight_decay 0.1): selected expert slices change; every other expert
    slice and every frozen group (router, attention, norms, shared experts, embeddings, lm_head, dense
    MLPs) is bit-identical."""
    model = build_tiny(family)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layers = [v.index for v in find_moe_layers(model)]
    experts = {layers[0]: [1, 6], layers[1]: [3]}
    module = MoELightningModule(model, "esft", options={"experts": experts}, optim={"lr": 1e-2, "weight_decay": 0.1})
    _train(module)
    groups = esft_parameter_groups(module.patch)
    for group, params in groups.items():
        for name, p in params:
            if group == "experts":
                layer = next(v for v in module.patch.views if name.startswith(v.name + "."))
                blocks = p.shape[0] // layer.num_experts  # DBRX: expert e owns rows e*I .. (e+1)*I-1
                for e in range(layer.num_experts):
                    rows = slice(e * blocks, (e + 1) * blocks)
                    changed = not torch.equal(p[rows], before[name][rows])
                    assert changed == (e in experts[layer.index]), f"{name}[{e}]"
            else:
                assert torch.equal(p, before[name]), f"{group}: {name} changed"
    assert sum(len(v) for v in groups.values()) == len(before)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_shared_experts_frozen_by_default_and_trainable_with_the_flag(family):
    for flag in (False, True):
        model = build_tiny(family)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        layers = [v.index for v in find_moe_layers(model)]
        module = MoELightningModule(model, "esft", options={"experts": {layers[0]: [0]},
                                                            "train_shared_experts": flag},
                                    optim={"lr": 1e-2, "weight_decay": 0.1})
        _train(module, steps=3)
        shared = esft_parameter_groups(module.patch)["shared_experts"]
        assert shared
        assert all(torch.equal(p, before[n]) != flag for n, p in shared)


@pytest.mark.parametrize("flag,group", [
    ("train_router", "router"), ("train_attention", "attention"), ("train_shared_experts", "shared_experts"),
    ("train_embeddings", "embeddings"), ("train_lm_head", "lm_head"), ("train_norms", "norms"),
    ("train_dense_mlp", "dense_mlp"),
])
def test_each_flag_unfreezes_exactly_its_group(flag, group):
    model = build_tiny("qwen2_moe")  # has every group: shared expert + gate, a dense layer, norms
    patch = moe_lab.apply(model, "esft", experts={0: [1]}, **{flag: True})
    groups = esft_parameter_groups(patch)
    assert groups[group]
    for name, params in groups.items():
        if name != "experts":
            assert all(p.requires_grad == (name == group) for _, p in params), name
    assert [v.experts.gate_up_proj.requires_grad for v in patch.views] == [True, False]  # layer 2: no expert


def test_apply_without_experts_explains_how_to_select():
    with pytest.raises(ValueError, match="esft_select"):
        moe_lab.apply(build_tiny("olmoe"), "esft")
    with pytest.raises(ValueError, match=r"out of range \[0, 8\)"):
        moe_lab.apply(build_tiny("olmoe"), "esft", experts={0: [8]})
    with pytest.raises(ValueError, match=r"layers \[5\] are not MoE layers"):
        moe_lab.apply(build_tiny("olmoe"), "esft", experts={5: [1]})


# JSON ----------------------------------------------------------------------------------------------
def test_json_round_trip_is_exact(tmp_path):
    model = build_tiny("deepseek_v3")
    scores = moe_lab.esft_scores(model, _padded_batches())
    selection = moe_lab.esft_select(scores, 0.3, score="gate")
    path = save_selection(tmp_path / "sel.json", selection, scores, score="gate", p=0.3)
    loaded = load_selection(path)
    assert loaded["experts"] == selection and loaded["score"] == "gate" and loaded["p"] == 0.3
    for layer in scores:
        for name in ("gate", "token"):
            assert torch.equal(loaded["scores"][layer][name], scores[layer][name])
    assert moe_lab.esft_select(loaded["scores"], 0.3, score="gate") == selection


def test_load_public_esft_expert_config_and_bad_files(tmp_path):
    (tmp_path / "expert_cfg.json").write_text(json.dumps(
        {"experts": {"1": [5, 2], "2": [0]}, "shared_experts": False, "non_expert_modules": False}))
    assert load_selection(tmp_path / "expert_cfg.json")["experts"] == {1: [2, 5], 2: [0]}
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_selection(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ValueError, match="neither 'experts' nor 'scores'"):
        load_selection(tmp_path / "empty.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_selection(tmp_path / "missing.json")


# Lightning: selection at fit start -----------------------------------------------------------------------
class _Data(L.LightningDataModule):
    def __init__(self, n=6):
        super().__init__()
        self.batches = [random_batch(batch=4, seq=12, seed=s) for s in range(n)]

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None)


def _esft_module(model, **kwargs):
    return ESFTLightningModule(model, optim={"lr": 1e-2, "weight_decay": 0.1}, **kwargs)


def test_fit_start_selection_artifact_and_checkpoint(tmp_path):
    model = build_tiny("olmoe")
    expected_scores = moe_lab.esft_scores(copy.deepcopy(model), _Data().batches[:3])
    expected = moe_lab.esft_select(expected_scores, 0.5, score="gate")
    module = _esft_module(model, score="gate", p=0.5, score_batches=3)
    trainer = L.Trainer(max_steps=2, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, datamodule=_Data())
    assert module.selection == expected
    artifact = load_selection(tmp_path / ARTIFACT)
    assert artifact["experts"] == expected and artifact["sequences"] == 12 and artifact["score_batches"] == 3
    for layer in expected_scores:
        assert torch.equal(artifact["scores"][layer]["gate"], expected_scores[layer]["gate"])
    ckpt = torch.load(next(tmp_path.rglob("*.ckpt")), weights_only=True)
    assert ckpt[CHECKPOINT_KEY]["experts"] == expected
    assert ckpt["hyper_parameters"]["options"]["experts"] == expected

    # resuming recomputes the same selection; a run with another selection refuses the checkpoint
    resumed = _esft_module(build_tiny("olmoe"), score="gate", p=0.5, score_batches=3)
    trainer = L.Trainer(max_steps=3, default_root_dir=tmp_path / "resume", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(resumed, datamodule=_Data(), ckpt_path=next(tmp_path.rglob("*.ckpt")))
    assert trainer.global_step == 3 and resumed.selection == expected
    other = _esft_module(build_tiny("olmoe"), options={"experts": {0: [0], 1: [0]}})
    trainer = L.Trainer(max_steps=3, default_root_dir=tmp_path / "other", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    with pytest.raises(ValueError, match="selection_file"):
        trainer.fit(other, datamodule=_Data(), ckpt_path=next(tmp_path.glob("checkpoints/*.ckpt")))


def test_selection_and_scores_files_skip_scoring(tmp_path):
    model = build_tiny("olmoe")
    scores = moe_lab.esft_scores(copy.deepcopy(model), _Data().batches[:2])
    save_selection(tmp_path / "sel.json", {0: [2], 1: [4, 5]}, scores)
    from_file = _esft_module(build_tiny("olmoe"), selection_file=str(tmp_path / "sel.json"))
    assert from_file.selection == {0: [2], 1: [4, 5]}
    rescored = _esft_module(build_tiny("olmoe"), scores_file=str(tmp_path / "sel.json"), p=0.6)
    assert rescored.selection == moe_lab.esft_select(scores, 0.6)
    trainer = L.Trainer(max_steps=1, default_root_dir=tmp_path / "run", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")
    trainer.fit(from_file, datamodule=_Data())
    assert load_selection(tmp_path / "run" / ARTIFACT)["experts"] == {0: [2], 1: [4, 5]}
    with pytest.raises(ValueError, match="selection given twice"):
        _esft_module(build_tiny("olmoe"), selection_file=str(tmp_path / "sel.json"), options={"experts": {0: [1]}})
    with pytest.raises(ValueError, match="method.p=0"):
        _esft_module(build_tiny("olmoe"), p=0)
    # LoRA: the selection must be known before the adapters are attached (they then train alone)
    with pytest.raises(ValueError, match="ESFT with lora needs its selection"):
        _esft_module(build_tiny("olmoe"), lora={"rank": 2})
    with_lora = _esft_module(build_tiny("olmoe"), lora={"rank": 2}, selection_file=str(tmp_path / "sel.json"))
    trainable = [n for n, p in with_lora.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek_v3", "phimoe"])
def test_twenty_steps_lower_the_loss_with_a_fit_start_selection(family, tmp_path):
    """ESFT-Token selected at fit start: 20 steps, falling loss (tests/methods/test_training.py trains every
    family with an explicit selection)."""
    torch.manual_seed(0)
    module = ESFTLightningModule(build_tiny(family), score="token", p=0.5, score_batches=2,
                                 optim={"lr": 1e-2, "weight_decay": 0.01})
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    batches = [random_batch(batch=4, seq=16, seed=s) for s in range(2)]
    trainer = L.Trainer(max_steps=20, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Record()], accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(batches * 10, batch_size=None))
    assert module.selection and all(module.selection.values())
    assert len(losses) == 20 and sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses


@pytest.mark.slow
def test_run_py_esft_token_writes_the_selection(tmp_path):
    out = tmp_path / "run"
    run_py("method=esft_token", "model=tiny_olmoe", "debug=fast", f"hydra.run.dir={out}", cwd=tmp_path)
    artifact = load_selection(out / ARTIFACT)
    assert artifact["score"] == "token" and artifact["p"] == 0.2 and 0 < artifact["sequences"] <= 16 * 8
    assert artifact["experts"] == moe_lab.esft_select(artifact["scores"], 0.2)
    assert (out / "export" / "model.safetensors").exists()


@pytest.mark.slow
def test_ddp_ranks_score_together_and_train_the_same_slices(tmp_path):
    """2-process DDP: each rank scores its shard, the sums are all-reduced, both ranks install the same
    selection (a rank-local selection would leak averaged gradients into the other rank's frozen slices)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from moe_lab.models import load_model

    out = tmp_path / "run"
    run_py("method=esft_token", "method.p=0.4", "hardware=ddp_cpu", "debug=fast", "task.trainer.max_steps=3",
           f"hydra.run.dir={out}", cwd=tmp_path)
    artifact = load_selection(out / ARTIFACT)
    assert artifact["experts"] == moe_lab.esft_select(artifact["scores"], 0.4)
    config = OmegaConf.load(out / "config.yaml")
    initial, tokenizer = load_model(config.model)
    data = instantiate(config.dataset, tokenizer=tokenizer)
    data.setup("fit")
    n_train = len(data.examples["train"])  # every train batch is scored; the sampler pads to 2 equal shards
    assert n_train < 16 * config.dataset.batch_size and artifact["sequences"] == 2 * math.ceil(n_train / 2)
    initial, _ = load_model(OmegaConf.load(ROOT / "conf" / "model" / "tiny_olmoe.yaml"))
    trained = transformers.AutoModelForCausalLM.from_pretrained(out / "export")
    before, after = initial.state_dict(), trained.state_dict()
    for key in before:
        if ".experts." in key:
            layer = int(key.split(".")[2])
            changed = [e for e in range(before[key].shape[0]) if not torch.equal(before[key][e], after[key][e])]
            assert changed == artifact["experts"][layer], key
        else:
            assert torch.equal(before[key], after[key]), key
