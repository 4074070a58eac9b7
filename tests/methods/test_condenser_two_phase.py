"""task=condenser_two_phase: phase 1 learns biases, phase 2 starts from the original weights with
condensers fixed from phase 1's bias file and its own gamma."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moe_lab.models import load_model
from moe_lab.tasks import run_task
from tests.conftest import ROOT

G1, G2 = 1e-3, 5e-5


def _cfg(out, *overrides, method=("method=condenser", "method.options.n=1")):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[
            "task=condenser_two_phase", *method, "callbacks=none", "logger=csv", "dataset.num_examples=24",
            "dataset.max_length=384", "task.trainer.val_check_interval=100", "task.checkpoint_every_n_steps=100",
            f"paths.output_dir={out}", "task.trainer.max_steps=3", "task.phase1.max_steps=4", *overrides])


def test_bad_configs_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="needs method=condenser, got method=sft"):
        run_task(_cfg(tmp_path, method=["method=sft"]))
    with pytest.raises(ValueError, match="method.options.n=0"):
        run_task(_cfg(tmp_path, method=["method=condenser", "method.options.n=0"]))
    with pytest.raises(ValueError, match="task.phase2.init='last'.*original, phase1"):
        run_task(_cfg(tmp_path, "task.phase2.init=last"))
    with pytest.raises(ValueError, match="task.phase1.bias_file"):
        run_task(_cfg(tmp_path, "task.ckpt_path=x.ckpt"))


@pytest.mark.slow
def test_two_phases_bias_file_condensers_and_original_weights(tmp_path):
    out = tmp_path / "run"
    # phase 1 trains the weights (lr 1e-2); phase 2 runs at lr 0, so its export must be the ORIGINAL weights
    cfg = _cfg(out, "task.phase1.lr=0.01", "task.optim.lr=0.0", "task.phase1.export=true")
    summary = run_task(cfg)
    p1 = json.loads((out / "phase1" / "condenser.json").read_text())["layers"]
    p2 = json.loads((out / "phase2" / "condenser.json").read_text())["layers"]
    assert summary["bias_file"] == str(out / "phase1" / "condenser.json")
    for i, first in p1.items():
        bias1, bias2 = torch.tensor(first["bias"]), torch.tensor(p2[i]["bias"])
        assert first["forced_experts"] == [] and first["updates"] == 4, "phase 1: biases only, 4 updates"
        steps = bias1 / G1
        assert torch.allclose(steps, steps.round(), atol=1e-3), "phase-1 biases are multiples of its gamma"
        used = first["usage"]
        assert sum(used) > 0 and all(u == int(u) for u in used), "integer loads summed over phase 1"
        # the lowest-bias expert, ties broken by phase-1 usage (sparsify: the least used)
        condenser = min(range(len(used)), key=lambda e: (first["bias"][e], used[e]))
        assert p2[i]["forced_experts"] == [condenser] and summary["condensers"][i] == [condenser]
        assert p2[i]["updates"] == 3, "phase 2's own updates"
        delta = (bias2 - bias1).double()
        assert delta[condenser] == 0, "the condenser's bias is frozen once chosen"
        others = torch.ones_like(delta, dtype=torch.bool)
        others[condenser] = False
        # 3 phase-2 updates of +-G2 each (float32 rounding of ~1e-3-sized biases: < 1e-9)
        assert (delta[others].abs() <= 3 * G2 + 1e-9).all() and (delta[others].abs() > 0).any()
    original, _ = load_model(cfg.model)
    import transformers

    final = transformers.AutoModelForCausalLM.from_pretrained(out / "phase2" / "export").state_dict()
    first = transformers.AutoModelForCausalLM.from_pretrained(out / "phase1" / "export").state_dict()
    for key, value in original.state_dict().items():
        assert torch.equal(final[key], value), f"phase 2 starts from the original weights: {key}"
    assert any(not torch.equal(first[k], v) for k, v in original.state_dict().items()), "phase 1 trained"
    assert json.loads((out / "summary.json").read_text())["phase1"]["global_step"] == 4
    for phase, steps in (("phase1", 4), ("phase2", 3)):  # task=evaluate labels exports from these
        saved = OmegaConf.load(out / phase / "config.yaml")
        assert saved.method.name == "condenser" and saved.task.trainer.max_steps == steps
    # phase 1's bias file given: phase 1 is skipped and phase 2 repeats exactly (same start, seed and data)
    again = tmp_path / "again"
    run_task(_cfg(again, "task.optim.lr=0.0", f"task.phase1.bias_file={out / 'phase1' / 'condenser.json'}"))
    assert not (again / "phase1").exists()
    assert json.loads((again / "phase2" / "condenser.json").read_text())["layers"] == p2
