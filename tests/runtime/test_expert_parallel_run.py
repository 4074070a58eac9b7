"""``python run.py hardware=ddp_cpu_ep`` (expert parallelism on 2 CPU processes, the dense part's AdamW state sharded
by ZeRO-1) as a user runs it: killed by SIGKILL on one rank, it resumes with ``task.resume=<run dir>`` to the
uninterrupted run's export, bit for bit; its checkpoint resumes under EP 1 (plain DDP, a plain AdamW), which then
trains what EP trains (the EP math against the single process is tests/runtime/test_expert_parallel.py); the export
is a vanilla checkpoint; ESFT under EP selects and trains as under DDP; what cannot run under EP is refused by name,
in the plan and the run."""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import safetensors.torch
import torch
import transformers

from moe_lab.methods import ep_support
from moe_lab.methods.distill import KDModule
from moe_lab.runs.checks import refuse_expert_parallel
from tests.conftest import ROOT
from tests.test_run import run_py

#: the condenser with its forward-only pre-phase before step 0 (a collective pass of its own under EP)
COMMON = ("debug=fast", "model=tiny_qwen3_moe", "~callbacks.expert_load", "task.checkpoint_every_n_steps=3",
          "task.keep_last_checkpoints=2", "method=condenser", "method.options.n=1", "method.options.selection_updates=2")


def _export(run: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(run / "export" / "model.safetensors")


def _losses(run: Path) -> list[float]:
    with open(run / "metrics.csv") as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


class KillOnce(L.Callback):
    """SIGKILL on rank ``rank`` right after optimizer step ``step``, once: ``marker`` records it (the resumed run,
    whose saved command line holds this callback too, then runs through)."""

    def __init__(self, step: int, rank: int, marker: str):
        self.step, self.rank, self.marker = step, rank, Path(marker)

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)


def _kill(tmp_path: Path) -> tuple[str, ...]:
    """kill -9 of rank 1 right after step 4 (the step-3 checkpoint is complete), as the signal matrix kills runs."""
    return ("+callbacks.kill._target_=tests.runtime.test_expert_parallel_run.KillOnce", "+callbacks.kill.step=4",
            "+callbacks.kill.rank=1", f"+callbacks.kill.marker={tmp_path / 'killed.marker'}")


@pytest.mark.slow
def test_ep_run_killed_resumes_bitwise_and_under_ep_1_where_it_equals_ddp(tmp_path, monkeypatch):
    ep, killed, as_ddp = (tmp_path / n for n in ("ep", "killed", "as_ddp"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # the callback
    proc = run_py(*COMMON, "hardware=ddp_cpu_ep", f"hydra.run.dir={ep}", cwd=tmp_path)
    assert "4 of 8 experts on EP rank 0 of 2" in proc.stdout + proc.stderr
    assert "the dense part's AdamW moments sharded over 2 ranks (ZeRO-1" in proc.stdout + proc.stderr
    a = _export(ep)
    # the export is whole: every expert, in vanilla transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(ep / "export")
    packed = [m.gate_up_proj for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert packed and all(t.shape[0] == 8 for t in packed)

    middle = ep / "checkpoints" / "step-3.ckpt"  # the EP run's checkpoint at step 3 of 6
    ckpt = torch.load(middle, weights_only=True)
    expert_keys = [k for k in ckpt["state_dict"] if k.endswith("experts.gate_up_proj")]
    assert expert_keys and all(ckpt["state_dict"][k].shape[0] == 8 for k in expert_keys)  # whole, not rank 0's half
    assert {s["exp_avg"].shape[0] for s in ckpt["optimizer_states"][0]["state"].values()
            if s["exp_avg"].dim() == 3} == {8}
    # killed: rank 1 dies by SIGKILL, rank 0 fails at its next collective; the documented resume continues from the
    # newest complete checkpoint (step 3) to the uninterrupted run's export, bit for bit
    proc = run_py(*COMMON, *_kill(tmp_path), "hardware=ddp_cpu_ep", f"hydra.run.dir={killed}", cwd=tmp_path, check=False)
    assert proc.returncode != 0 and not (killed / "export").exists()
    run_py(*COMMON, "hardware=ddp_cpu_ep", f"task.resume={killed}", cwd=tmp_path)
    c = _export(killed)
    assert all(torch.equal(a[k], c[k]) for k in a), "EP resume after kill -9 is not bitwise"
    assert _losses(killed) == _losses(ep)
    resume = f"task.ckpt_path={middle}"
    # EP 2 -> EP 1 (plain DDP) for steps 4-6: EP changes where the experts live and the order of float32 sums,
    # nothing else (clipping at 1.0 included), so the losses and the export are the EP run's
    run_py(*COMMON, "hardware=ddp_cpu", resume, f"hydra.run.dir={as_ddp}", cwd=tmp_path)
    assert _losses(as_ddp)[-3:] == pytest.approx(_losses(ep)[-3:], rel=1e-6, abs=1e-6) and len(_losses(ep)) == 6
    d = _export(as_ddp)
    assert d.keys() == a.keys()
    assert (as_ddp / "export" / "condenser.json").read_text() == (ep / "export" / "condenser.json").read_text()
    for key in a:
        torch.testing.assert_close(d[key], a[key], rtol=0, atol=1e-6, msg=key)


#: ESFT-Token scores its selection at fit start under EP (a collective pass over every rank's batches) and trains
#: the selected slices of each rank's local experts, nothing dense: DDP has nothing to wrap
ESFT = ("debug=fast", "model=tiny_qwen3_moe", "callbacks.expert_load.log_every_n_steps=2", "method=esft_token",
        "task.trainer.max_steps=4", "task.checkpoint_every_n_steps=2", "task.keep_last_checkpoints=2")


@pytest.mark.slow
def test_esft_under_ep_selects_and_trains_as_ddp_and_resumes_bitwise(tmp_path):
    ep, ddp, resumed = (tmp_path / n for n in ("ep", "ddp", "resumed"))
    proc = run_py(*ESFT, "hardware=ddp_cpu_ep", f"hydra.run.dir={ep}", cwd=tmp_path)
    assert "only expert tensors train, so DDP does not wrap the model" in proc.stdout + proc.stderr
    run_py(*ESFT, "hardware=ddp_cpu", f"hydra.run.dir={ddp}", cwd=tmp_path)
    chosen = [json.loads((run / "esft_selection.json").read_text()) for run in (ep, ddp)]
    assert chosen[0]["experts"] == chosen[1]["experts"] and chosen[0]["tokens"] == chosen[1]["tokens"]
    for layer, scores in chosen[1]["scores"].items():
        assert chosen[0]["scores"][layer]["token"] == pytest.approx(scores["token"], abs=1e-9), layer
    a, b = _export(ep), _export(ddp)
    assert _losses(ep) == pytest.approx(_losses(ddp), rel=1e-6, abs=1e-6) and len(_losses(ep)) == 4
    # every logged value (expert load, routing drift, gradient norms, lr, losses) is the DDP run's, under its name
    rows = [list(csv.DictReader((run / "metrics.csv").read_text().splitlines())) for run in (ep, ddp)]
    assert len(rows[0]) == len(rows[1]) and rows[0][0].keys() == rows[1][0].keys()
    assert {"load/gini_mean", "drift/kl_mean", "grad_norm/experts", "lr-AdamW"} <= rows[0][0].keys()
    for mine, theirs in zip(*rows):
        for key, value in theirs.items():
            assert (mine[key] == value == "") or float(mine[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), key
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():  # both reload in vanilla transformers, whole (8 experts), with the same logits
        logits = [transformers.AutoModelForCausalLM.from_pretrained(run / "export")(ids).logits for run in (ep, ddp)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
    middle = ep / "checkpoints" / "step-2.ckpt"
    run_py(*ESFT, "hardware=ddp_cpu_ep", f"task.ckpt_path={middle}", f"hydra.run.dir={resumed}", cwd=tmp_path)
    c = _export(resumed)
    assert all(torch.equal(a[k], c[k]) for k in a), "ESFT EP resume is not bitwise"
    assert torch.load(middle, weights_only=True)["moe_lab_esft"]["optimizer_layout"] == "packed"  # whole local tensors


def test_an_esft_checkpoint_of_ep_does_not_resume_under_ep_1():
    """EP keeps whole local expert tensors in ESFT's optimizer (layout ``packed``), EP 1 only the trained slices: a
    checkpoint of one does not resume under the other, refused by name at configure_optimizers."""
    from moe_lab.methods.esft_module import ESFTLightningModule
    from tests.conftest import build_tiny

    module = ESFTLightningModule(build_tiny("qwen3_moe"), options={"experts": {1: [0, 5]}})
    module._resumed_optimizer_layout = "packed"
    with pytest.raises(ValueError, match=r"holds optimizer state for packed expert tensors, but this run steps sliced "
                                         r"ones .*hardware.ep_size \(> 1 or 1\) that wrote it"):
        module.configure_optimizers()


@pytest.mark.slow
def test_every_other_method_runs_under_ep_with_lora_on_every_target(tmp_path):
    """One grid, each point a 2-process EP run of run.py with LoRA on experts, attention and the rest: the methods
    the two tests above do not run (the EP arithmetic of each against the single process:
    tests/runtime/test_expert_parallel.py)."""
    methods = ["sft", "sft_aux_free", "frozen_router", "densemixer", "compressed_experts"]
    sweep = tmp_path / "sweep"
    run_py("-m", "debug=fast", "model=tiny_qwen3_moe", "hardware=ddp_cpu_ep", "task.trainer.max_steps=2",
           f"method={','.join(methods)}", "method.lora={rank:4,alpha:8}", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    runs = sorted((p for p in sweep.iterdir() if (p / "summary.json").exists()), key=lambda p: int(p.name[0]))
    assert [r.name.split("tiny_qwen3_moe_")[1] for r in runs] == methods
    for run in runs:
        log = (run / "run.log").read_text()
        assert "4 of 8 experts on EP rank 0 of 2" in log and "moments sharded over 2 ranks" in log, run.name
        assert json.loads((run / "summary.json").read_text())["global_step"] == 2, run.name
        adapters = safetensors.torch.load_file(run / "export" / "adapter" / "adapter_model.safetensors")
        experts = [v for k, v in adapters.items() if "experts" in k and "lora_A" in k]  # PEFT: [E x rank, in]
        assert experts and all(v.shape[0] == 8 * 4 for v in experts), run.name  # every expert's adapter, gathered


class _Module:
    def __init__(self, method, name=None, **attrs):
        self.method, self.hparams, self.patch = method, {"name": name or method}, None
        self.__dict__.update(attrs)


@pytest.mark.parametrize("method,reason", [("mystery", "not proven under expert parallelism")])
def test_methods_that_cannot_run_under_ep_are_refused_by_name(method, reason):
    with pytest.raises(ValueError, match=rf"method={method} under hardware.ep_size=2: .*{reason}") as refused:
        ep_support.check_method(_Module(method), 2)
    listed = str(refused.value).split("the methods that run under EP: ")[1].split(" (and their variants")[0]
    assert sorted(listed.split(", ")) == sorted(["sft", "frozen_router", "condenser", "densemixer", "esft",
                                                 "compressed_experts"])
    ep_support.check_method(_Module(method), 1)  # no EP: nothing to refuse


def test_ep_refusals_for_strategy_masters_and_kd():
    with pytest.raises(ValueError, match=r"hardware.ep_size=8 under a deepspeed_zero3 strategy.*hardware=gpu_ep"):
        refuse_expert_parallel(_Module("sft"), "deepspeed_zero3", 8)
    with pytest.raises(ValueError, match=r"master_weights=optimizer.*master_weights=fp32"):
        ep_support.check_method(_Module("sft", master_weights="optimizer"), 2)
    with pytest.raises(ValueError, match=r"method=kd under hardware.ep_size=2: the teacher"):
        ep_support.check_method(type("KD", (_Module,), {"expert_parallel_refusal": KDModule.expert_parallel_refusal})(
            "sft", name="kd"), 2)  # the refusal KDModule states, read off the module's class
    refuse_expert_parallel(_Module("condenser"), "ddp", 2)
    refuse_expert_parallel(_Module("densemixer"), "ddp", 2)


@pytest.mark.slow
def test_plan_refuses_a_method_under_ep_as_the_run_does(tmp_path):
    proc = run_py("debug=fast", "model=tiny_qwen3_moe", "hardware=ddp_cpu_ep", "method=compressed_experts",
                  "method.options.form=gate_up_intermediate", "plan=true", f"hydra.run.dir={tmp_path / 'plan'}",
                  cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "method=compressed_experts under hardware.ep_size=2: compressed_experts' form=gate_up_intermediate" \
        in proc.stderr
