"""Paper presets (conf/experiment) against the papers' hyper-parameters, and the experiments collector.

The expected values below are written from docs/specs/finetuning.md section 2 (and the public code it
cites), not read from the presets, so a preset that drifts from the paper fails here.
"""

from __future__ import annotations

import csv
import functools
import json
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments import collect
from tests.conftest import ROOT

CONF = ROOT / "conf"
EXPERIMENTS = CONF / "experiment"

OLMOE_0125, OLMOE_0924 = "allenai/OLMoE-1B-7B-0125", "allenai/OLMoE-1B-7B-0924"
QWEN15, DSV2 = "Qwen/Qwen1.5-MoE-A2.7B", "deepseek-ai/DeepSeek-V2-Lite"
DSMOE16 = "checkpoints/deepseek-moe-16b-base-qwen2moe"  # moe_lab.convert deepseek_moe output
HF_BETAS, HF_WD = [0.9, 0.999], 0.0  # HF Trainer defaults, used where a paper and its code are silent


def _hp(model, dataset, lr, batch, epochs, seq, warmup, schedule, eval_group, wd=HF_WD, betas=HF_BETAS,
        clip=1.0, steps=-1, **extra):
    return dict(model=model, dataset=dataset, lr=lr, global_batch=batch, epochs=epochs, steps=steps, seq=seq,
                warmup_ratio=warmup, schedule=schedule, eval=eval_group, wd=wd, betas=betas, clip=clip, **extra)


# preset -> hyper-parameters (docs/specs/finetuning.md section 2; "Pub" = the public code the spec quotes)
CONDENSER_OLMOE = _hp(OLMOE_0125, "math7k", 2e-5, 256, 2, 4096, 0.03, "linear", "math7")  # DenseMixer Pub OLMoE
CONDENSER_QWEN = _hp(QWEN15, "math7k", 1e-5, 64, 2, 4096, 0.1, "cosine", "math7")  # DenseMixer Pub Qwen1.5
S1 = {"lr": 1e-5, "batch": 16, "epochs": 5, "seq": 16384, "warmup": 0.05, "schedule": "cosine",
      "eval_group": "hard_reasoning"}
# DoRA commonsense_reasoning: llama3_8B_DoRA.sh (lr 1e-4, batch 16, 3 epochs, cutoff 256), finetune.py (warm-up 100
# steps, linear, weight decay 0, adamw_torch, max_grad_norm 1.0)
DORA = {"lr": 1e-4, "batch": 16, "epochs": 3, "seq": 256, "warmup": 0.0, "schedule": "linear",
        "eval_group": "commonsense8", "warmup_steps": 100}
CE = {"lr": 2e-5, "batch": 128, "epochs": 2, "seq": 4096, "warmup": 0.03, "schedule": "cosine", "eval_group": "lm_eval"}
EXPECTED = {
    "condenser/math_olmoe": CONDENSER_OLMOE,
    "olmoe_math_sft": {**CONDENSER_OLMOE, "method": "sft"},
    "condenser/math_qwen1_5": CONDENSER_QWEN,
    "condenser/math_dsv2lite": {**CONDENSER_QWEN, "model": DSV2},
    "condenser/math_gptoss": {**CONDENSER_QWEN, "model": "openai/gpt-oss-20b"},
    # Table 3: "the hyper-parameters described in (Liu et al., 2024b)": DoRA's commonsense scripts (NVlabs/DoRA)
    "condenser/commonsense_olmoe": _hp(OLMOE_0125, "commonsense15k", **DORA),
    "condenser/commonsense_qwen1_5": _hp(QWEN15, "commonsense15k", **DORA),
    # ablations (Appendix M.1 / M.2, P.1, P.2): the main table's training on the paper's models
    "condenser/ablation_m1_dsv2lite": {**CONDENSER_QWEN, "model": DSV2, "method": "condenser"},
    "condenser/ablation_m1_qwen1_5": {**CONDENSER_QWEN, "method": "condenser"},
    "condenser/ablation_m2_dsv2lite": {**CONDENSER_QWEN, "model": DSV2, "method": "condenser"},
    "condenser/ablation_m2_qwen1_5": {**CONDENSER_QWEN, "method": "condenser"},
    "condenser/gamma_dsv2lite": {**CONDENSER_QWEN, "model": DSV2, "method": "condenser"},
    "condenser/gamma_qwen1_5": {**CONDENSER_QWEN, "method": "condenser"},
    "esft/epochs_olmoe": {**CONDENSER_OLMOE, "method": "esft_token"},
    "esft/epochs_dsv2lite": {**CONDENSER_QWEN, "model": DSV2, "method": "esft_token"},
    "condenser/s1_qwen3": _hp("Qwen/Qwen3-30B-A3B-Base", "s1k", **S1),  # Table 17 = DenseMixer's Base rows
    "condenser/s1_dscoder": _hp("deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct", "s1k", **S1),
    "condenser/s1_qwen1_5": _hp(QWEN15, "s1k", **S1),
    "densemixer/esft_olmoe": _hp(OLMOE_0125, "esft_intent", 2e-5, 256, 4, 4096, 0.03, "linear", "esft"),
    "densemixer/esft_qwen1_5": _hp(QWEN15, "esft_intent", 1e-5, 64, 3, 4096, 0.1, "cosine", "esft"),
    "densemixer/s1_qwen3_base": _hp("Qwen/Qwen3-30B-A3B-Base", "s1k", **S1),
    "densemixer/gsm_olmoe": _hp(OLMOE_0125, "gsm8k_train", 2e-5, 256, 4, 4096, 0.03, "linear", "lm_eval"),
    "densemixer/gsm_qwen1_5": _hp(QWEN15, "gsm8k_train", 1e-5, 64, 3, 4096, 0.1, "cosine", "lm_eval"),
    "densemixer/codealpaca_olmoe": _hp(OLMOE_0125, "codealpaca", 2e-5, 256, 4, 4096, 0.03, "linear", "lm_eval"),
    "densemixer/codealpaca_qwen1_5": _hp(QWEN15, "codealpaca", 1e-5, 64, 3, 4096, 0.1, "cosine", "lm_eval"),
    "densemixer/nemotron_code_qwen3_base": _hp("Qwen/Qwen3-30B-A3B-Base", "nemotron_code", **{**S1, "eval_group": "lm_eval"}),
    # the public code's own Nemotron config (LLaMA-Factory nemocode_sl16k_bs64_lr3e-5.yaml)
    "densemixer/nemotron_code_qwen3_base_pub": _hp("Qwen/Qwen3-30B-A3B-Base", "nemotron_code",
                                                   **{**S1, "eval_group": "lm_eval", "lr": 3e-5, "batch": 64, "epochs": 1}),
    "compressed_experts/olmoe": _hp(OLMOE_0924, "mathinstruct", **CE),
    "compressed_experts/olmoe_topk_half": _hp(OLMOE_0924, "mathinstruct", **CE, top_k=4, method="sft"),
    "compressed_experts/phimoe": _hp("microsoft/Phi-3.5-MoE-instruct", "mathinstruct", **{**CE, "lr": 1e-5}),
    "compressed_experts/phimoe_topk_half": _hp("microsoft/Phi-3.5-MoE-instruct", "mathinstruct",
                                               **{**CE, "lr": 1e-5}, top_k=1, method="sft"),
    "esft/dsv2lite": _hp(DSV2, "esft_intent", 1e-5, 128, -1, 4096, 0.0, "constant", "esft", wd=0.1,
                         betas=[0.9, 0.95], steps=500),
}
TINY = {"tiny_grid", "condenser/tiny_grid"}  # CPU stand-ins: composed and run, no paper values

# compression presets (docs/specs/compression.md): [P2] distillation recipe (2.11) and CD-MoE (3.3, 3.9)
KD_RECIPE = {"lr": 1e-4, "wd": 0.01, "betas": [0.9, 0.95], "warmup_steps": 20, "schedule": "cosine", "min_lr_ratio": 0.1,
                 "global_batch": 384, "block": 4096, "steps": 200, "calib": (512, 2048), "loss": "forward_kl"}
COMPRESSION = {
    "moe_to_dense/qwen3_30b_a3b": dict(KD_RECIPE, model="Qwen/Qwen3-30B-A3B", K=8),  # best Table-12 cell K
    "moe_to_dense/deepseek_v2_lite": dict(KD_RECIPE, model=DSV2, K=6),
    "moe_to_dense/gpt_oss_20b": dict(KD_RECIPE, model="openai/gpt-oss-20b", K=4),
    "moe_to_dense/qwen3_30b_a3b_kprime": dict(KD_RECIPE, model="Qwen/Qwen3-30B-A3B", K=8),  # Table 4 sweep
    # D2D baseline (App. M): Table 13's search on 1,024 WikiText-103 samples, then the same KD recipe
    "moe_to_dense/d2d_qwen3_32b": {"model": "Qwen/Qwen3-32B", "d2d": "prune", "calib": (1024, 2048)},
    "moe_to_dense/d2d_distill_qwen3_32b": dict(KD_RECIPE, model="Qwen/Qwen3-32B", d2d="distill"),
    # CD-MoE: S keeps no routed expert, SR keeps the active routed count (DeepSeek 6, Qwen1.5 4); C4 search data
    # 100 documents x 256 tokens (CD-code); layer counts of the paper's main rows
    "condense/deepseek_moe_s": {"model": DSMOE16, "routed": 0, "layers": 8},
    "condense/deepseek_moe_sr": {"model": DSMOE16, "routed": 6, "layers": 9},
    "condense/qwen1_5_moe_s": {"model": QWEN15, "routed": 0, "layers": 6},
    "condense/qwen1_5_moe_sr": {"model": QWEN15, "routed": 4, "layers": 6},
    # CD-MoE + SFT (3.8, A4-3) on Commonsense-170K: the paper's lr 1e-4, 10% warm-up, cosine, bf16; [CD-code]'s
    # 1 epoch, batch 8, 256 tokens; cd_sft_recipe=code: lr 1e-5, linear, a C4 epoch (10k x 256 tokens) first
    "condense/deepseek_moe_s_sft": {"model": DSMOE16, "routed": 0, "layers": 8, "sft": "commonsense170k"},
    "condense/deepseek_moe_sr_sft": {"model": DSMOE16, "routed": 6, "layers": 9, "sft": "commonsense170k"},
    "condense/qwen1_5_moe_s_sft": {"model": QWEN15, "routed": 0, "layers": 6, "sft": "commonsense170k"},
    "condense/qwen1_5_moe_sr_sft": {"model": QWEN15, "routed": 4, "layers": 6, "sft": "commonsense170k"},
}
CD_MOE_TASKS = {"arc_challenge", "boolq", "hellaswag", "mmlu", "openbookqa", "piqa", "rte", "winogrande"}


def _presets() -> list[str]:
    return sorted(p.relative_to(EXPERIMENTS).with_suffix("").as_posix() for p in EXPERIMENTS.rglob("*.yaml")
                  if p.parent.name != "row")


def _rows() -> list[str]:
    return sorted(p.stem for p in (EXPERIMENTS / "row").glob("*.yaml"))


@functools.cache
def _compose(*overrides):
    """The composed config (cached: several tests read the same composition; none mutates it)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1]


def test_every_preset_has_expected_values():
    assert set(_presets()) == set(EXPECTED) | TINY | set(COMPRESSION)


@pytest.mark.parametrize("preset", sorted(COMPRESSION))
def test_compression_preset_carries_the_papers_values(preset):
    want = COMPRESSION[preset]
    cfg = _compose(f"experiment={preset}")
    assert cfg.model.pretrained == want["model"]
    if preset.startswith("condense/"):
        c = cfg.condense
        assert (c.routed_experts, c.num_layers, c.metric, c.target) == (want["routed"], want["layers"], "js",
                                                                        "hidden_softmax")
        assert (c.expert_selection, c.layer_selection) == ("greedy", "greedy")
        assert (c.search.num_sequences, c.search.seq_len) == (100, 256)
        assert set(c.eval.tasks) == CD_MOE_TASKS
        if "sft" in want:
            task, data, choices = cfg.task, cfg.dataset, cfg.hydra.runtime.choices
            assert (choices.task, choices.method, choices.dataset) == ("cd_moe_sft", "condense_sft", want["sft"])
            assert (task.optim.lr, task.scheduler.name, task.scheduler.warmup_ratio, task.scheduler.warmup_steps,
                    task.scheduler.min_lr_ratio) == (1e-4, "cosine", 0.1, 0, 0.0)
            assert (task.trainer.max_epochs, task.trainer.max_steps, cfg.cd_sft.lm_stage) == (1, -1, None)
            global_batch = data.batch_size * task.trainer.accumulate_grad_batches * cfg.hardware.trainer.devices
            assert (global_batch, data.max_length) == (8, 256)
            assert cfg.hardware.trainer.precision == "bf16-mixed" and cfg.model.dtype == "bfloat16"
            code = _compose(f"experiment={preset}", "cd_sft_recipe=code")
            lm = code.cd_sft.lm_stage.dataset
            assert (code.task.optim.lr, code.task.scheduler.name, code.task.trainer.max_epochs) == (1e-5, "linear", 1)
            assert (lm.path, lm.block_size, lm.batch_size, lm.num_blocks) == ("allenai/c4", 256, 8, 10000)
        return
    if want.get("d2d") == "prune":
        assert cfg.model.pretrained == want["model"] and cfg.task.name == "d2d_prune"
        assert (cfg.compress.calibration.num_sequences, cfg.compress.calibration.seq_len) == want["calib"]
        assert len(cfg.task.candidates) == 5
        return
    task, data = cfg.task, cfg.dataset
    assert cfg.hydra.runtime.choices.method == "kd" and cfg.method.options.loss == want["loss"]
    assert cfg.hydra.runtime.choices.dataset == "fineweb_edu" and data.block_size == want["block"]
    assert data.batch_size * task.trainer.accumulate_grad_batches * cfg.hardware.trainer.devices == want["global_batch"]
    assert task.trainer.max_steps == want["steps"]
    assert task.optim.lr == want["lr"] and task.optim.weight_decay == want["wd"]
    assert list(task.optim.betas) == want["betas"]
    s = task.scheduler
    assert (s.name, s.warmup_steps, s.min_lr_ratio) == (want["schedule"], want["warmup_steps"], want["min_lr_ratio"])
    if want.get("d2d") == "distill":  # the pruned student from its dense teacher: no conversion
        assert cfg.method.teacher.pretrained == want["model"] and cfg.task.name == "finetune"
        return
    assert (cfg.compress.score, cfg.compress.grouping, cfg.compress.K) == ("do_acp", "rr", want["K"])
    assert (cfg.compress.calibration.num_sequences, cfg.compress.calibration.seq_len) == want["calib"]


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_preset_carries_the_papers_hyper_parameters(preset):
    want = EXPECTED[preset]
    cfg = _compose(f"experiment={preset}")
    task, data = cfg.task, cfg.dataset
    assert cfg.model.pretrained == want["model"]
    assert cfg.hydra.runtime.choices.dataset == want["dataset"]
    # the papers' 8 x 80 GB node, a sharded setting that fits by moe-lab's estimate (tests/runtime/test_plan.py checks the fit)
    assert cfg.hydra.runtime.choices.hardware.endswith("_8gpu") and cfg.hardware.trainer.devices == 8
    assert cfg.hardware.trainer.precision == "bf16-mixed" and cfg.model.dtype == "bfloat16"
    assert task.optim.lr == pytest.approx(want["lr"], rel=0, abs=0)
    assert data.batch_size * task.trainer.accumulate_grad_batches * cfg.hardware.trainer.devices == want["global_batch"]
    assert (task.trainer.max_epochs, task.trainer.max_steps) == (want["epochs"], want["steps"])
    assert data.max_length == want["seq"]
    assert task.scheduler.name == want["schedule"]
    assert task.scheduler.warmup_ratio == want["warmup_ratio"]
    assert task.scheduler.warmup_steps == want.get("warmup_steps", 0)
    assert task.scheduler.min_lr_ratio == 0.0  # HF/TRL schedules decay to 0
    assert task.optim.weight_decay == want["wd"] and list(task.optim.betas) == want["betas"]
    assert task.trainer.gradient_clip_val == want["clip"]
    assert cfg.eval.name == want["eval"]
    assert cfg.hydra.runtime.choices.method == want.get("method", "sft")
    if "top_k" in want:
        assert cfg.model.config.num_experts_per_tok == want["top_k"] and cfg.method.name == "sft_topk_half"


@pytest.mark.parametrize("preset", sorted(EXPECTED) + sorted(TINY))
def test_preset_sets_only_keys_the_configs_define(preset):
    """Hydra merges a preset's keys without checking them: a typo (warmup_ration) would pass silently."""
    cfg = _compose(f"experiment={preset}")
    choices = cfg.hydra.runtime.choices
    groups = ("model", "dataset", "method", "hardware", "eval", "logger", "callbacks")
    base = _compose(*(f"{group}={choices[group]}" for group in groups if choices.get(group) is not None))
    known = set(_leaves(OmegaConf.to_container(base)))
    extra = [k for k in _leaves(OmegaConf.to_container(cfg)) if k not in known and not k.startswith(
        ("model.config.", "hydra.", "eval.lm_eval.tasks."))]  # lm_eval.tasks: a free {column: task} mapping
    assert not extra, f"{preset} sets keys no config group defines: {extra}"


def test_main_rows_use_the_papers_method_knobs():
    condenser = _compose("experiment=condenser/math_olmoe", "method=condenser").method
    assert (condenser.options.gamma, condenser.options.n, condenser.options.select, condenser.options.budget,
            condenser.aux_loss_coef) == (1e-4, 2, "lowest_bias", "replace", 0.0)
    assert _compose("experiment=esft/dsv2lite", "method=esft_token").method.p == 0.2
    ce = _compose("experiment=compressed_experts/olmoe", "method=compressed_experts").method
    assert ce.options.k_main is None and ce.options.full_finetune is True  # k_main = k/2, full fine-tuning


ROWS = {  # row file -> (method group, label, method knobs)
    "condenser": ("condenser", "condenser", {"options.n": 2, "options.select": "lowest_bias", "options.gamma": 1e-4}),
    "condenser_aux_free": ("sft_aux_free", "aux_free", {}),
    "condenser_aux_free_bias": ("condenser", "aux_free_bias", {"options.n": 0, "options.gamma": 1e-4}),
    "condenser_highest_bias": ("condenser", "condenser_highest_bias", {"options.select": "highest_bias",
                                                                       "options.n": 2}),
    # LoRA rows: the method decides whether the router trains (sft, densemixer: full rank; frozen_router: no)
    "densemixer_lora_conventional": ("sft", "sft_lora", {"lora.rank": 8, "lora.alpha": 16}),
    "densemixer_lora_frozen_router": ("frozen_router", "frozen_router_lora", {"lora.rank": 8, "lora.alpha": 16}),
    "densemixer_lora_densemixer": ("densemixer", "densemixer_lora", {"lora.rank": 8, "lora.alpha": 16}),
    # DenseMixer Tables 7/8 full fine-tuning rows: the method alone
    "densemixer_conventional": ("sft", "sft", {}),
    "densemixer_frozen_router": ("frozen_router", "frozen_router", {}),
    "densemixer_densemixer": ("densemixer", "densemixer", {}),
    "densemixer_esft_gate": ("esft_gate", "esft_gate", {}),
    "densemixer_esft_token": ("esft_token", "esft_token", {}),
    "compressed_experts_k_main_sweep": ("compressed_experts", "compressed_experts_kNone", {}),
    "sft_top_k_sweep": ("sft", "sft_top8", {}),
    "densemixer_dense_forward_conventional_gradient": ("densemixer", "densemixer_dense_conventional",
                                                       {"options.forward": "dense", "options.gradient": "conventional"}),
}


def test_every_row_file_is_checked():
    assert set(_rows()) == set(ROWS)


@pytest.mark.parametrize("row", sorted(ROWS))
def test_row_files_set_method_label_and_knobs(row):
    group, label, knobs = ROWS[row]
    cfg = _compose("experiment=condenser/math_olmoe", f"+experiment/row={row}")
    assert cfg.hydra.runtime.choices.method == group and cfg.method.name == label
    for key, value in knobs.items():
        assert OmegaConf.select(cfg.method, key) == value, key
    assert cfg.task.optim.lr == (2e-4 if "lora" in row else 2e-5)  # LoRA: Pub lr range 2e-4 .. 5e-4
    if "lora" in row:
        assert set(cfg.method.lora.targets) == {"experts", "shared_experts", "attention", "dense_mlp"}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_row_methods_build_on_a_tiny_model(row):
    """Each row's method config is accepted by its LightningModule (options, LoRA settings) on tiny OLMoE."""
    from hydra.utils import instantiate

    from moe_lab.models import load_model

    cfg = _compose("experiment=condenser/tiny_grid", f"+experiment/row={row}",
                   *(["method.options.k_main=2"] if "k_main" in row else []))
    model, _ = load_model(cfg.model)
    module = instantiate(cfg.method, model=model, optim=cfg.task.optim, scheduler=cfg.task.scheduler,
                         _recursive_=False)
    router = [p for n, p in module.named_parameters() if n.endswith("mlp.gate.weight")]
    frozen = ROWS[row][0] == "frozen_router" or ROWS[row][0].startswith("esft")  # ESFT: only chosen experts train
    assert router and all(p.requires_grad != frozen for p in router)
    if "lora" in row:
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        assert any("lora" in n for n in trainable) and all("lora" in n or "gate.weight" in n for n in trainable)


def test_k_main_sweeps_run_table_1():
    """Table 1's two columns: w/ CE (k_main 1, 2, 4 of OLMoE's top-8) and w/o CE (top-k cut to 1, 2, 4; Top-8 is the
    main Top-k SFT run): the jobs of the two row sweeps plus that run are exactly reported.csv's k_main sweep rows."""
    jobs = set()
    for row, key in (("compressed_experts_k_main_sweep", "method.options.k_main"),
                     ("sft_top_k_sweep", "model.config.num_experts_per_tok")):
        base = ("experiment=compressed_experts/olmoe", f"+experiment/row={row}")
        values = str(_compose(*base).hydra.sweeper.params[key]).split(",")
        assert [int(v) for v in values] == [1, 2, 4], row
        for value in values:
            cfg = _compose(*base, f"{key}={value}")
            assert OmegaConf.select(cfg, key) == int(value)
            if row == "compressed_experts_k_main_sweep":  # w/ CE: the model keeps its top-8 router
                assert OmegaConf.select(cfg, "model.config.num_experts_per_tok") is None
            jobs.add((cfg.method.name, cfg.hydra.runtime.choices.dataset))
    jobs.add(("sft", "mathinstruct"))  # Top-8 w/o CE: the main Top-k SFT run
    reported = {(r["row"], r["train"]) for r in collect.load_reported("compressed_experts")
                if r["table"] == "k_main sweep"}
    assert jobs == reported


@pytest.mark.parametrize("row", [r for r in sorted(ROWS) if r.endswith("_sweep")])
def test_sweep_rows_pin_their_method_over_the_presets_rows(row):
    """A sweep row added to a preset that sweeps its table's methods runs its own method only (the sweeper's
    params merge: without the pin, -m would run every method x every swept value)."""
    preset = "compressed_experts/olmoe" if row.startswith("compressed") else "condenser/math_olmoe"
    cfg = _compose(f"experiment={preset}", f"+experiment/row={row}")
    assert cfg.hydra.sweeper.params["method"] == ROWS[row][0] == cfg.hydra.runtime.choices.method


def test_evaluate_sweeps_its_checkpoints_not_the_presets_rows():
    """Step 2 (`python run.py -m task=evaluate experiment=<preset> task.checkpoint=a,b`) runs one job per
    checkpoint: the preset's table rows (its sweeper params) are the training jobs' only."""
    for preset in ("condenser/math_olmoe", "densemixer/esft_olmoe", "condenser/ablation_m1_dsv2lite"):
        assert _compose(f"experiment={preset}").hydra.sweeper.params
        assert _compose(f"experiment={preset}", "task=evaluate").hydra.sweeper.params is None


# sweep presets -> (the swept key, extra overrides, reported.csv table): their jobs are exactly the table's rows
SWEEPS = {
    "condenser/gamma_qwen1_5": ("method.options.gamma", (), "Gamma sweep"),  # Table 13
    "condenser/gamma_dsv2lite": ("method.options.gamma", (), "Gamma sweep"),  # Table 14
    "condenser/ablation_m1_qwen1_5": ("experiment/row", (), "Ablation M.1"),  # Table 9
    "condenser/ablation_m1_dsv2lite": ("experiment/row", (), "Ablation M.1"),
    "condenser/ablation_m2_qwen1_5": ("experiment/row", (), "Ablation M.2"),  # Table 10
    "condenser/ablation_m2_dsv2lite": ("experiment/row", (), "Ablation M.2"),
    "esft/epochs_olmoe": ("task.trainer.max_epochs", (), "ESFT epochs Math7K"),  # Table 12
    "esft/epochs_olmoe math14k": ("task.trainer.max_epochs", ("dataset=math14k",), "ESFT epochs Math14K"),  # 11
    "esft/epochs_dsv2lite": ("task.trainer.max_epochs", (), "ESFT epochs Math7K"),  # Table 12
}


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_table_sweeps_run_exactly_the_papers_rows(sweep):
    """Each job of a table's sweep preset is one reported.csv row (model, row label, training data), and the
    sweep covers every row of that table for that model; gamma rows are bias-only (n 0, aux loss off)."""
    key, extra, table = SWEEPS[sweep]
    preset = f"experiment={sweep.split()[0]}"
    values = str(_compose(preset, *extra).hydra.sweeper.params[key]).split(",")
    jobs = set()
    for value in values:
        cfg = _compose(preset, *extra, f"{key}={value}")
        jobs.add((cfg.model.name, cfg.method.name, cfg.hydra.runtime.choices.dataset))
        if key == "method.options.gamma":
            assert (cfg.method.options.n, cfg.method.aux_loss_coef) == (0, 0.0)
            assert cfg.method.options.gamma == float(value)
        if key == "task.trainer.max_epochs":
            assert cfg.task.trainer.max_epochs == int(value) and cfg.hydra.runtime.choices.method == "esft_token"
    model = {cfg.model.name}
    reported = {(r["model"], r["row"], r["train"]) for r in collect.load_reported("condenser")
                if r["table"] == table and r["model"] in model}
    assert len(jobs) == len(values) and jobs == reported


@pytest.mark.parametrize("preset,tiny", [("condenser/gamma_qwen1_5", "tiny_qwen2_moe"),
                                         ("condenser/gamma_dsv2lite", "tiny_deepseek_v2")])
def test_bias_only_rows_learn_biases_and_train_weights_from_step_zero(preset, tiny):
    """n 0 (aux-free+bias, the gamma tables): no condensers and no frozen warm-up; one update moves every bias by
    +-gamma (sign(mean load - load), sparsify: the overloaded experts up) and the weights keep their gradients."""
    import torch
    from hydra.utils import instantiate

    from moe_lab.models import load_model

    cfg = _compose(f"experiment={preset}", f"model={tiny}", "method.options.gamma=5e-5")
    model, _ = load_model(cfg.model)
    module = instantiate(cfg.method, model=model, optim=cfg.task.optim, scheduler=cfg.task.scheduler,
                         _recursive_=False)
    updater = module.patch.bias_updater
    assert not updater.pending  # n 0: no condensers to choose, so no selection pre-phase
    ids = torch.randint(3, cfg.model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    module.model(input_ids=ids, labels=ids).loss.backward()
    loads = updater.global_loads()
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)  # every weight trains
    updater()
    for layer, load in zip(module.patch.layers, loads):
        want = -5e-5 * torch.sign(load.mean() - load)
        assert torch.equal(layer.bias, want.float()) and not layer.forced_experts


def test_reported_rows_are_labels_our_presets_produce():
    methods = {p.stem for p in (CONF / "method").glob("*.yaml")}
    produced = methods | {"sft_topk_half"} | {label for _, label, _ in ROWS.values()}
    from moe_lab.runs.condense import METHODS as CONDENSE_METHODS

    # CD-MoE rows: the unmodified model, and task=condense's methods (cd_moe as its S / SR variants); "base": a
    # model evaluated without a checkpoint (task=evaluate's label)
    produced |= {"original", "cd_moe_s", "cd_moe_sr", "base"} | set(CONDENSE_METHODS)
    # sweep rows are labelled per job (method.name with the swept value); ESFT epochs: esft_token_epochs<n>
    sweeps = ("Gamma sweep", "k_main sweep", "ESFT epochs")
    for paper in collect.papers():
        for row in collect.load_reported(paper):
            assert row["row"] in produced or row["table"].startswith(sweeps), (paper, row["row"])
            assert (CONF / "model").joinpath(f"{row['model']}.yaml").is_file(), (paper, row["model"])


def _readme_commands() -> list[str]:
    """Every ``python run.py ...`` command in experiments/**/README.md (inline or in a code block)."""
    commands = []
    for readme in sorted((ROOT / "experiments").rglob("README.md")):
        text = readme.read_text()
        commands += re.findall(r"`(python run\.py [^`]*)`", text)
        joined = re.sub(r"\\\n\s*", " ", text)
        commands += [line.strip() for line in joined.splitlines() if line.strip().startswith("python run.py ")]
    return commands


def _override_variants(command: str) -> list[tuple[str, ...]]:
    """The Hydra overrides of a documented command, one variant per value of each comma-separated sweep
    (the others at their first value); shell substitutions, placeholders and hydra.* settings left out."""
    command = re.sub(r"\$\([^)]*\)|\S*<[^>]*>\S*", "", command).replace("${t}", "intent").replace("$t", "intent")
    tokens = [t for t in shlex.split(command)[2:] if t != "-m" and not t.endswith(("=", "=..."))
              and not t.startswith("hydra.")]
    sweeps = {k: t.split("=", 1) for k, t in enumerate(tokens) if "," in t and "[" not in t}
    first = [f"{sweeps[k][0]}={sweeps[k][1].split(',')[0]}" if k in sweeps else t for k, t in enumerate(tokens)]
    variants = {tuple(first)}
    for k, (key, values) in sweeps.items():
        variants |= {(*first[:k], f"{key}={v}", *first[k + 1:]) for v in values.split(",")}
    return sorted(variants)


def test_readme_commands_compose():
    """The commands the experiments READMEs document are valid (every swept value composes)."""
    commands = _readme_commands()
    assert len(commands) >= 15
    for command in commands:
        for overrides in _override_variants(command):
            _compose(*overrides)


# ----------------------------------------------------------------------------------------------------
# The collector on synthetic result directories


def _finetune_run(root: Path, name: str, dataset: str) -> Path:
    run = root / name
    (run / "export").mkdir(parents=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      dataset: {dataset}\n")
    (run / "summary.json").write_text(json.dumps({"model": "x", "method": "y", "global_step": 3}))
    return run


def _eval_run(path: Path, model: str, method: str, cells: dict, checkpoint, limit=None, temperature=0.0):
    path.mkdir(parents=True)
    table = [{"model": model, "method": method, "column": c, "value": v, "averaged": True} for c, v in cells.items()]
    (path / "summary.json").write_text(json.dumps({"model": model, "method": method, "table": table,
                                                   "columns": list(cells), "limit": limit,
                                                   "checkpoint": None if checkpoint is None else str(checkpoint)}))
    (path / "config.yaml").write_text(f"eval:\n  name: math7\n  generation:\n    temperature: {temperature}\n")


def _reported(path: Path, rows: list[tuple]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(collect.FIELDS)
        writer.writerows(rows)
    return path


@pytest.fixture
def sweep(tmp_path):
    """A finetune sweep (math7k) and an evaluate sweep (multirun.yaml, numbered jobs) over its exports."""
    sft = _finetune_run(tmp_path / "ft", "0_olmoe_0125_sft", "math7k")
    cond = _finetune_run(tmp_path / "ft", "1_olmoe_0125_condenser", "math7k")
    (tmp_path / "ft" / "multirun.yaml").write_text("task:\n  name: finetune\n")
    ev = tmp_path / "ev"
    _eval_run(ev / "0_olmoe_0125_sft", "olmoe_0125", "sft", {"GSM8K": 40.0, "SVAMP": 60.0}, sft / "export")
    _eval_run(ev / "1_olmoe_0125_condenser", "olmoe_0125", "condenser", {"GSM8K": 45.5, "SVAMP": 62.0,
              "AQuA": None}, cond / "export", limit=8)  # AQuA skipped (unavailable): a partial average
    (ev / "multirun.yaml").write_text("task:\n  name: evaluate\n")
    return tmp_path


def _lines(text: str) -> list[list[str]]:
    """The body rows of the printed markdown tables, as lists of cells (header lines left out)."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    return [r for r in rows if r[0] != "model"]


def test_collector_prints_ours_next_to_the_paper_with_differences(sweep, tmp_path, capsys):
    paper = _reported(tmp_path / "reported.csv", [
        ("Math7K", "OLMoE", "olmoe_0125", "SFT", "sft", "math7k", "", "GSM8K", "acc", "50.0", "test"),
        ("Math7K", "OLMoE", "olmoe_0125", "SFT", "sft", "math7k", "", "SVAMP", "acc", "", "test"),
        ("Math7K", "OLMoE", "olmoe_0125", "SFT", "sft", "math7k", "", "Avg.", "acc", "52.25", "test"),
        ("Math7K", "OLMoE", "olmoe_0125", "Ours", "condenser", "math7k", "", "GSM8K", "acc", "44", "test"),
        ("Math7K", "OLMoE", "olmoe_0125", "Ours", "condenser", "math7k", "", "Avg.", "acc", "50", "test"),
        ("Math14K", "OLMoE", "olmoe_0125", "SFT", "sft", "math14k", "", "GSM8K", "acc", "51", "test"),
    ])
    out = tmp_path / "cmp"
    assert collect.main(["condenser", str(sweep / "ev"), "--reported", str(paper), "--out", str(out)]) == 0
    rows = _lines(capsys.readouterr().out)
    body = {(r[1], r[3]): r[5:] for r in rows if r[0] == "OLMoE"}
    assert body[("SFT", "GSM8K")] == ["50.00", "40.00", "-10.00"]
    assert body[("SFT", "SVAMP")] == ["n/a", "60.00", "n/a"]  # no paper value: n/a, no difference
    assert body[("SFT", "Avg.")] == ["52.25", "50.00", "-2.25"]  # (40 + 60) / 2
    assert body[("Ours", "GSM8K")] == ["44.00", "45.50*", "+1.50"]  # eval.limit run marked
    assert body[("Ours", "Avg.")] == ["50.00", "53.75*+", "+3.75"]  # (45.5 + 62) / 2 over 2 of 3 sets
    assert len(body) == 5  # Math14K: trained on math7k, so no match, not shown
    unmatched = [r for r in rows if r[0] == "olmoe_0125"]  # ours without a paper cell
    assert {(r[1], r[3]) for r in unmatched} == {("condenser", "SVAMP")}
    with open(out / "comparison.csv") as f:
        saved = {(r["method"], r["benchmark"]): r for r in csv.DictReader(f)}
    assert float(saved[("SFT", "GSM8K")]["diff"]) == -10.0 and saved[("SFT", "SVAMP")]["paper"] == ""
    assert (out / "comparison.md").read_text().startswith("### Math7K")


def test_collector_reads_single_runs_and_real_layouts(sweep, capsys):
    """A single run directory against the shipped condenser layout: the paper's Table 2 numbers beside ours (the
    OLMoE Math7K SFT row: GSM8K 63.6, MAWPS 72.4), differences ours - paper."""
    run = sweep / "ev" / "0_olmoe_0125_sft"
    assert collect.main(["condenser", str(run)]) == 0
    rows = _lines(capsys.readouterr().out)
    olmoe = {r[3]: r[5:] for r in rows if r[0] == "OLMoE-1B-7B-0125" and r[1] == "SFT"}
    assert olmoe["GSM8K"] == ["63.60", "40.00", "-23.60"] and olmoe["MAWPS"] == ["72.40", "n/a", "n/a"]
    assert {(r[0], r[1]) for r in rows if r[0] != "olmoe_0125"} == {("OLMoE-1B-7B-0125", "SFT")}
    assert collect.main(["condenser", str(run), "--all"]) == 0  # every paper row, ours or not
    rows = _lines(capsys.readouterr().out)
    assert {r[0] for r in rows} >= {"OLMoE-1B-7B-0125", "DeepSeek-V2-Lite", "GPT-OSS-20B"}


def test_collector_matches_eval_settings_and_aliases(tmp_path, capsys):
    ft = _finetune_run(tmp_path, "run", "math_data")
    _eval_run(tmp_path / "ev_t06", "tiny_olmoe", "sft", {"AIME24": 10.0}, ft / "export", temperature=0.6)
    paper = _reported(tmp_path / "reported.csv", [
        ("S1 T0.6", "Q", "qwen", "C", "sft", "s1k", "generation.temperature=0.6", "AIME24", "pass@1", "12", "t"),
        ("S1 T1.0", "Q", "qwen", "C", "sft", "s1k", "generation.temperature=1.0", "AIME24", "pass@1", "9", "t"),
    ])
    argv = [str(tmp_path / "ev_t06"), "--reported", str(paper), "--as", "tiny_olmoe=qwen", "--as", "math_data=s1k"]
    assert collect.main(["x", *argv]) == 0
    rows = _lines(capsys.readouterr().out)
    assert [r[5:] for r in rows if r[0] == "Q"] == [["12.00", "10.00", "-2.00"]]  # T=1.0 table not shown


def test_collector_explains_wrong_directories(sweep, tmp_path, capsys):
    assert collect.main(["condenser", str(sweep / "ft")]) == 2
    assert "holds no task=evaluate run" in capsys.readouterr().err
    assert collect.main(["condenser", str(sweep / "ft" / "0_olmoe_0125_sft")]) == 2
    assert "not a task=evaluate run" in capsys.readouterr().err
    assert collect.main(["condenser", str(tmp_path / "nowhere")]) == 2
    assert "neither a task=evaluate run directory" in capsys.readouterr().err
    assert collect.main(["nopaper", str(sweep / "ev")]) == 2
    assert f"choose a paper from {', '.join(collect.papers())}" in capsys.readouterr().err
