"""task=condenser_two_phase: phase 1 learns biases, phase 2 starts from phase 1's model (the authors' rebuttal
configs; or the original weights) with condensers fixed from phase 1's bias file and its own gamma."""

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
    missing = tmp_path / "nowhere" / "condenser.json"
    with pytest.raises(ValueError, match=rf"task.phase2.init=phase1 starts from phase 1's export, and "
                                         rf"{tmp_path / 'nowhere' / 'export'} .* holds none"):
        run_task(_cfg(tmp_path, f"task.phase1.bias_file={missing}"))
    with pytest.raises(ValueError, match=r"task.batch_size=0: give an integer >= 1"):
        run_task(_cfg(tmp_path, "task.batch_size=0"))


def test_defaults_are_the_rebuttal_configs(tmp_path):
    """experiments_rebuttal/rebuttal_general_to_math/configs/phase{1,2}_ec_alpaca.yaml: 1 epoch per phase, lr 1e-5,
    per-device batch 4, no accumulation, cosine_with_min_lr (min_lr_rate 0.1), warm-up ratio 0.1, gamma 1e-3 then
    5e-5, phase 2 from phase 1's model."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["task=condenser_two_phase", "method=condenser_public_code"])
    task = cfg.task
    assert (task.trainer.max_epochs, task.trainer.max_steps, task.trainer.accumulate_grad_batches) == (1, -1, 1)
    assert (task.optim.lr, task.batch_size, task.scheduler.name, task.scheduler.min_lr_ratio,
            task.scheduler.warmup_ratio) == (1e-5, 4, "cosine", 0.1, 0.1)
    assert (task.phase1.gamma, task.phase2.gamma, task.phase2.init, task.phase1.lr) == (1e-3, 5e-5, "phase1", None)


@pytest.mark.slow
@pytest.mark.parametrize("init", ["phase1", "original"])
def test_two_phases_bias_file_condensers_and_starting_weights(tmp_path, init):
    out = tmp_path / "run"
    # phase 1 trains the weights (lr 1e-2); phase 2 runs at lr 0, so its export must be its STARTING weights:
    # phase 1's export (init=phase1, the rebuttal configs) or the original model (init=original)
    cfg = _cfg(out, "task.phase1.lr=0.01", "task.optim.lr=0.0", f"task.phase2.init={init}")
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
    start = first if init == "phase1" else original.state_dict()
    for key, value in start.items():
        assert torch.equal(final[key], value), f"phase 2 starts from the {init} weights: {key}"
    assert any(not torch.equal(first[k], v) for k, v in original.state_dict().items()), "phase 1 trained"
    assert json.loads((out / "summary.json").read_text())["phase1"]["global_step"] == 4
    for phase, steps in (("phase1", 4), ("phase2", 3)):  # task=evaluate labels exports from these
        saved = OmegaConf.load(out / phase / "config.yaml")
        assert saved.method.name == "condenser" and saved.task.trainer.max_steps == steps
        assert saved.dataset.batch_size == 4, "task.batch_size is both phases' per-device batch"
    if init == "original":
        return
    # phase 1's bias file given: phase 1 is skipped, phase 2 starts from the export beside it and repeats exactly
    again = tmp_path / "again"
    run_task(_cfg(again, "task.optim.lr=0.0", f"task.phase1.bias_file={out / 'phase1' / 'condenser.json'}"))
    assert not (again / "phase1").exists()
    assert json.loads((again / "phase2" / "condenser.json").read_text())["layers"] == p2


@pytest.mark.slow
def test_task_resume_reuses_phase_1_and_continues_phase_2(tmp_path):
    """task.resume=<run dir>: a finished phase 1 is reused (its bias file untouched) and phase 2, cut short (no
    done-marker; a kill leaves none), continues from its own last.ckpt."""
    from moe_lab.runs.stage import STAGE_DONE

    out = tmp_path / "run"
    run_task(_cfg(out, "task.checkpoint_every_n_steps=1"))
    bias = out / "phase1" / "condenser.json"
    written = bias.stat().st_mtime_ns
    (out / "phase2" / STAGE_DONE).unlink()
    summary = run_task(_cfg(out, "task.checkpoint_every_n_steps=1", f"task.resume={out}",
                            "task.trainer.max_steps=4"))
    assert bias.stat().st_mtime_ns == written and summary["phase1"]["global_step"] == 4
    assert summary["global_step"] == 4 and summary["resumed_from_step"] == 3
    assert json.loads((out / "phase2" / "condenser.json").read_text())["layers"]["0"]["updates"] == 4
