"""Every real-model preset RUNS end to end on its family's tiny sibling (lightning-hydra-template's
``experiment=glob(*)`` habit): the same preset with ``model=tiny_<family> hardware=cpu``, local data (a few rows
of the packaged math_data.json in each dataset's format), one epoch (epoch-based presets) or two
optimizer steps (step-based ones); the export is written and reloads.

What changes besides model, hardware and data, and why (``SIZE`` below): only numbers bound to the real model's
size or the real data's length: sequence lengths (the tiny models have 512 positions), CD-MoE's number of
condensed layers and kept routed experts (the tiny models have 2 MoE layers and top-2), MoE-to-dense's calibration
size, and the step count and accumulation of step-based presets (200 steps of 96 micro-batches on CPU is hours).
Epoch-based presets keep their accumulation, schedule and warm-up ratio: that is the epoch path (``max_steps=-1``)
the preflight used to refuse. Evaluation: finetune presets evaluate in a separate ``task=evaluate`` run (not part
of a preset's run); CD-MoE presets' lm-eval hub tasks are not available offline and are replaced by two rows of
moe-lab's offline ``llm_adapters_boolq`` task.

The condense presets need a calibration file (their documented first step, ``task=calibrate``): the test runs it.
Every run happens in-process through ``run.execute`` (what ``python run.py`` calls after Hydra composes the
config), which saves the ~10 s interpreter start-up per preset; ``test_issue_command_runs_through_run_py`` runs
the issue's command line once through ``python run.py`` itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir

import run
from tests.conftest import DATA_DIR
from tests.presets import CONF, compose_preset, data_overrides, real_model_presets, tiny_sibling

pytestmark = pytest.mark.slow

PRESETS = real_model_presets()
#: run in the default (slow) suite: every task kind, dataset format and model family once (~1/3 of the CPU time of
#: all presets). The rest carry the ``all_presets`` marker and run with MOE_LAB_ALL_PRESETS=1:
#:   MOE_LAB_ALL_PRESETS=1 python -m pytest -m all_presets tests/test_presets_run.py
REPRESENTATIVE = {
    "compressed_experts/olmoe",      # finetune, packing, epochs (the issue's example), OLMoE
    "compressed_experts/phimoe",     # PhiMoE
    "condenser/math_gptoss",         # GPT-OSS, LLM-Adapters rows
    "condenser/s1_qwen3",            # reasoning traces, Qwen3-MoE
    "densemixer/gsm_qwen1_5",        # prompt/completion rows, Qwen1.5-MoE (Qwen2-MoE)
    "densemixer/nemotron_code_qwen3_base",  # ShareGPT turns
    "esft/dsv2lite",                 # chat rows, step-based, DeepSeek-V2
    "moe_to_dense/qwen3_30b_a3b",    # task=moe_to_dense: calibration, conversion, distillation (text blocks)
    "condense/qwen1_5_moe_sr",       # task=calibrate then task=condense
    "condense/deepseek_moe_s_sft",   # task=cd_moe_sft
}
ALL_PRESETS = pytest.mark.skipif(not os.environ.get("MOE_LAB_ALL_PRESETS"),
                                 reason="MOE_LAB_ALL_PRESETS=1 runs every preset (see REPRESENTATIVE)")


def _param(preset: str):
    return preset if preset in REPRESENTATIVE else pytest.param(preset, marks=[pytest.mark.all_presets, ALL_PRESETS])
TINY_TOP_K, TINY_MOE_LAYERS = 2, 2  # every conf/model/tiny_*.yaml: 8 experts, top-2, 2 MoE layers
SEARCH = {"num_sequences": 4, "seq_len": 16, "batch_size": 2, "sample": "documents"}  # the presets' own mode


def _size_overrides(cfg) -> list[str]:
    """Numbers bound to the real model's size or the real data's length (module docstring)."""
    out = []
    task = cfg.task
    if "trainer" in task:
        if task.trainer.max_steps == -1:
            out.append("task.trainer.max_epochs=1")  # one short epoch, the preset's accumulation and schedule
        else:
            out += ["task.trainer.max_steps=2", "task.trainer.accumulate_grad_batches=1"]
    if task.name in ("condense", "cd_moe_sft"):
        c = cfg.condense
        out += [f"condense.num_layers={min(int(c.num_layers), TINY_MOE_LAYERS - 1)}",
                f"condense.routed_experts={min(int(c.routed_experts), TINY_TOP_K)}",
                *[f"condense.search.{k}={v}" for k, v in SEARCH.items()],
                "condense.eval.tasks=[llm_adapters_boolq]", "condense.eval.limit=2", "condense.eval.hub_tasks=false",
                "condense.eval.batch_size=2"]
    if task.name == "moe_to_dense":
        out += ["compress.calibration.num_sequences=4", "compress.calibration.seq_len=16",
                f"compress.K={min(int(cfg.compress.K), 4)}", "compress.eval.max_length=32", "compress.eval.stride=32"]
    return out


def _calibrate(preset: str, tmp: Path, text: str, dtype: str) -> str:
    """The condense presets' first step (their header): task=calibrate of the same model on the same search data."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "task=calibrate", f"model={tiny_sibling(preset)}", f"model.dtype={dtype}", "hardware=cpu",
            f"paths.output_dir={tmp / 'calibrate'}",
            "dataset@compress.calibration.dataset=c4", f"compress.calibration.dataset.path={text}",
            "compress.calibration.dataset.name=null", *[f"compress.calibration.{k}={v}" for k, v in SEARCH.items()]])
    return run.execute(cfg)["calibration"]


def preset_overrides(preset: str, tmp: Path, row: tuple[str, ...] = (), hardware: tuple[str, ...] = ("hardware=cpu",)
                     ) -> list[str]:
    """The overrides that run ``preset`` (with its table ``row``) on its tiny sibling under ``hardware``, on local
    data, at the sizes of the module docstring."""
    base = [*row, f"model={tiny_sibling(preset)}", *hardware, f"paths.output_dir={tmp / 'run'}"]
    cfg = compose_preset(preset, *base)
    over = [*base, *data_overrides(cfg, tmp / "data"), *_size_overrides(cfg)]
    if cfg.task.name == "moe_to_dense":
        text = next(o.split("=", 1)[1] for o in over if o.startswith("dataset.path="))
        over.append(f"compress.eval.path={text}")
    if cfg.task.name == "condense":
        text = next(o.split("=", 1)[1] for o in over if o.startswith("condense.search.dataset.path="))
        over.append(f"condense.calibration_file={_calibrate(preset, tmp, text, cfg.model.dtype)}")
    return over


def run_preset(preset: str, tmp: Path, *extra: str) -> dict:
    overrides = [f"experiment={preset}", *preset_overrides(preset, tmp), *extra]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return run.execute(cfg)


def _exports(summary: dict) -> list[Path]:
    """Every export a preset's run writes (finetune / condense: ``export``; cd_moe_sft: the condensed model and the
    SFT export; moe_to_dense: the distilled student)."""
    found = [summary.get("export"), (summary.get("condense") or {}).get("export"),
             (summary.get("sft") or {}).get("export"), (summary.get("distill") or {}).get("export")]
    return [Path(p) for p in found if p]


def _reload(path: Path):
    """The export loads back: moe-lab's condensed format with its loader, everything else in vanilla HF."""
    if (path / "condense_manifest.json").is_file():
        from moe_lab.compress.condense import load_condensed

        return load_condensed(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("preset", [_param(p) for p in PRESETS])
def test_preset_runs_on_its_tiny_sibling(preset, tmp_path):
    summary = run_preset(preset, tmp_path)
    exports = _exports(summary)
    assert exports, f"{preset}: no export in {sorted(summary)}"
    for path in exports:
        assert (path / "config.json").is_file(), path
        model = _reload(path).eval()
        with torch.no_grad():
            logits = model(torch.tensor([[1, 40, 41, 42]])).logits
        assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()
    if summary.get("global_step") is not None:  # finetune presets: the run trained and logged its loss, even a
        assert summary["global_step"] >= 1       # one-step epoch (shorter than log_every_n_steps)
        assert "train_loss.png" in summary["plots"]


# The condensers are chosen by the forward-only pre-phase before step 0 (one bias update here, on the tiny data),
# then the run trains all its 2 optimizer steps (accumulation 1) with them.
def test_flagship_condenser_method_runs_and_chooses_condensers(tmp_path):
    summary = run_preset("condenser/math_olmoe", tmp_path, "method=condenser",
                         "method.options.selection_updates=1", "task.trainer.accumulate_grad_batches=1")
    assert summary["global_step"] == 2
    state = json.loads((Path(summary["export"]).parent / "condenser.json").read_text())
    assert [len(layer["forced_experts"]) for layer in state["layers"].values()] == [2] * TINY_MOE_LAYERS


def test_issue_command_runs_through_run_py(tmp_path):
    """The command of issue 17 (refused before by the preflight: max_steps=-1), through ``python run.py`` (8 rows;
    max_length: the preset's 4096 is above the tiny model's 512 positions)."""
    from tests.test_run import run_py

    proc = run_py("experiment=compressed_experts/olmoe", "model=tiny_olmoe", "hardware=cpu", "dataset=math_data",
                  f"dataset.path={DATA_DIR / 'math_data.json'}", "dataset.num_examples=8", "dataset.max_length=512",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert "run finished" in proc.stdout and (tmp_path / "run" / "export" / "config.json").is_file()
