"""``method.master_weights=optimizer``: bf16 compute weights, fp32 masters in the optimizer. A bf16 model trained
through the LightningModule (accumulation, clipping, weight decay) takes exactly the steps of a hand-written loop
that keeps fp32 copies; resumes bitwise through run.py; is refused where it cannot run."""

from __future__ import annotations

import copy
import logging

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from moe_lab.methods.base import MoELightningModule
from moe_lab.runtime.optimizer_masters import STATE_KEY, masters_of, refuse_optimizer_masters
from moe_lab.runtime.strategies import refuse_unsupported
from tests.conftest import random_batch
from tests.runtime.test_precision import _bf16_model

LR, WD, CLIP, ACCUMULATE = 2e-4, 0.01, 0.05, 2
BATCHES = [random_batch(batch=2, seq=8, seed=s) for s in range(2 * ACCUMULATE)]


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                     precision="bf16-mixed", **kwargs)


def _fit(model, master_weights="optimizer", **trainer_kwargs) -> MoELightningModule:
    module = MoELightningModule(model, "sft", optim={"lr": LR, "weight_decay": WD}, master_weights=master_weights)
    trainer = _trainer(max_steps=len(BATCHES) // ACCUMULATE, accumulate_grad_batches=ACCUMULATE,
                       gradient_clip_val=CLIP, enable_checkpointing=False, **trainer_kwargs)
    trainer.fit(module, DataLoader(BATCHES, batch_size=None))
    return module


def _oracle(bf16_model) -> tuple[dict, dict]:
    """The same steps by hand: bf16 weights under CPU bf16 autocast, gradients accumulated in bf16 over the window,
    cast to fp32 copies, clipped by their global norm, AdamW on the copies (decay on matrices only, as the module
    groups them), each copy rounded into its bf16 weight. Returns (bf16 parameters, fp32 masters) by name."""
    model = copy.deepcopy(bf16_model).train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    order = [x for x in named if x[1].dim() >= 2] + [x for x in named if x[1].dim() < 2]
    masters = {n: p.detach().float() for n, p in order}
    opt = torch.optim.AdamW([{"params": [masters[n] for n, p in order if p.dim() >= 2], "weight_decay": WD},
                             {"params": [masters[n] for n, p in order if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=1e-8)
    for start in range(0, len(BATCHES), ACCUMULATE):
        for batch in BATCHES[start:start + ACCUMULATE]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss
            (loss / ACCUMULATE).backward()
        for n, p in order:
            masters[n].grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_([masters[n] for n, _ in order], CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in order:
                p.copy_(masters[n])
    return {n: p.detach() for n, p in model.named_parameters()}, masters


def test_bf16_weights_step_fp32_masters_exactly_like_the_oracle(caplog, one_thread):
    base = _bf16_model()
    expected, expected_masters = _oracle(base)
    model = copy.deepcopy(base)
    with caplog.at_level(logging.INFO, logger="moe_lab.core.precision"):
        module = _fit(model)
    assert any("stay bfloat16 for compute; the optimizer steps fp32 copies" in r.getMessage() for r in caplog.records)
    got = dict(model.named_parameters())
    assert {p.dtype for p in got.values()} == {torch.bfloat16}
    for n, value in expected.items():
        assert torch.equal(got[n].detach(), value), n
    masters = masters_of(module.trainer.optimizers[0])
    by_param = {id(p): m for p, m in masters.pairs}
    assert len(masters) == len(expected_masters)
    for n, value in expected_masters.items():
        assert by_param[id(got[n])].dtype == torch.float32 and torch.equal(by_param[id(got[n])], value), n
    # the point of the masters: updates below the bf16 spacing accumulate in fp32 where the weight cannot hold them
    finer = sum(int((m.to(torch.bfloat16).float() != m).sum()) for _, m in masters.pairs)
    assert finer > 0.5 * sum(m.numel() for _, m in masters.pairs)


def test_fp32_mode_and_optimizer_mode_take_the_same_steps_up_to_bf16_rounding():
    """The two modes differ only in where the fp32 values live: after two steps the fp32 mode's parameters, rounded
    to bf16, are the optimizer mode's within a few bf16 spacings (the gradients differ by bf16 accumulation only)."""
    base = _bf16_model()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    _fit(a, master_weights="fp32")
    _fit(b)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        spacing = torch.finfo(torch.bfloat16).eps * pa.detach().abs().clamp_min(1e-3)
        assert torch.all((pa.detach() - pb.detach().float()).abs() <= 4 * spacing + 4 * LR), n


def test_optimizer_state_carries_the_masters_and_refuses_a_checkpoint_without_them():
    module = _fit(_bf16_model())
    optimizer = module.trainer.optimizers[0]
    state = optimizer.state_dict()
    masters = masters_of(optimizer)
    assert [tuple(t.shape) for t in state[STATE_KEY]] == [tuple(m.shape) for _, m in masters.pairs]
    saved = [t.clone() for t in state[STATE_KEY]]
    with torch.no_grad():
        for _, m in masters.pairs:
            m.add_(1.0)
    optimizer.load_state_dict(state)
    assert all(torch.equal(m, t) for (_, m), t in zip(masters.pairs, saved))
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in masters.pairs)
    state.pop(STATE_KEY)
    with pytest.raises(ValueError, match=r"no fp32 master copies.*master_weights=fp32.*method\.master_weights="):
        optimizer.load_state_dict(state)


def test_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match=r"hardware=fsdp.*master_weights=fp32"):
        refuse_optimizer_masters("sft", "fsdp", "bf16-mixed", False)
    with pytest.raises(ValueError, match=r"trainer\.precision=32-true.*hardware\.trainer\.precision=bf16-mixed"):
        refuse_optimizer_masters("sft", "single", "32-true", False)
    with pytest.raises(ValueError, match=r"trainer\.precision=16-mixed"):
        refuse_optimizer_masters("sft", "ddp", "16-mixed", False)
    with pytest.raises(ValueError, match=r"method=esft_token: .*slice optimizer"):
        refuse_optimizer_masters("esft_token", "single", "bf16-mixed", True)
    refuse_optimizer_masters("sft", "deepspeed_zero3", "bf16-mixed", False)  # its engine keeps masters already
    module = MoELightningModule(_bf16_model(), "sft", master_weights="optimizer")
    with pytest.raises(ValueError, match=r"hardware=fsdp"):
        refuse_unsupported(module, "fsdp", "bf16-mixed")  # what plan=true and the run call
    with pytest.raises(ValueError, match=r"trainer\.precision=32-true"):
        _fit_precision("32-true")
    with pytest.raises(ValueError, match=r"no trainable parameter is half precision \(model\.dtype=float32\)"):
        _fit(_bf16_model().float())


def _fit_precision(precision: str) -> None:
    module = MoELightningModule(_bf16_model(), "sft", master_weights="optimizer")
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", precision=precision)
    trainer.fit(module, DataLoader(BATCHES[:1], batch_size=None))


@pytest.mark.slow
def test_run_py_trains_resumes_bitwise_and_exports_in_bf16(tmp_path):
    """The documented flag through run.py: 4 steps straight equal 2 steps, a checkpoint, and 2 resumed steps, bit
    for bit (weights and masters); the export reloads in vanilla transformers as bf16."""
    import safetensors.torch
    import transformers

    from tests.test_run import run_py

    common = ("debug=fast", "~callbacks.expert_load", "model.dtype=bfloat16", "hardware.trainer.precision=bf16-mixed",
              "method.master_weights=optimizer", "task.checkpoint_every_n_steps=2", "task.keep_last_checkpoints=2",
              "dataset.num_examples=64", "task.trainer.max_steps=4")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_py(*common, f"hydra.run.dir={straight}", cwd=tmp_path)
    assert "the optimizer steps fp32 copies (method.master_weights=optimizer)" in proc.stdout + proc.stderr
    run_py(*common, f"task.ckpt_path={straight / 'checkpoints' / 'step-2.ckpt'}", f"hydra.run.dir={resumed}",
           cwd=tmp_path)
    a = safetensors.torch.load_file(straight / "export" / "model.safetensors")
    b = safetensors.torch.load_file(resumed / "export" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {v.dtype for v in a.values()} == {torch.bfloat16}
    ckpts = [torch.load(d / "checkpoints" / "last.ckpt", weights_only=True) for d in (straight, resumed)]
    masters = [c["optimizer_states"][0][STATE_KEY] for c in ckpts]
    assert len(masters[0]) == len(masters[1]) > 0 and all(torch.equal(x, y) for x, y in zip(*masters))
    assert all(x.dtype == torch.float32 for x in masters[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(straight / "export")
    assert model.dtype == torch.bfloat16


def test_bench_flow_and_its_state_ratio(monkeypatch, capsys):
    """bench/master_weights.py end to end at a short length (its step ratio is for docs/results.md, not asserted).
    The state it holds after a step is exact arithmetic: every parameter trains, so per entry bf16 weight (2) + fp32
    master (4) + AdamW's two moments (8) against fp32 weight (4) + moments (8), plus AdamW's 4-byte step counters."""
    import runpy

    from tests.conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = runpy.run_path(str(ROOT / "bench" / "master_weights.py"))
    _, state = bench["main"](["--steps", "1", "--warmup", "0", "--batch", "1", "--seq", "16", "--threads", "1"])
    assert "step_ratio=" in capsys.readouterr().out
    assert state["optimizer"] / state["fp32"] == pytest.approx(14 / 12, rel=1e-3)
