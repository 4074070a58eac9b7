"""Expert Condenser's selection protocol: the forward-only pre-phase (selection=pre_phase, the default) takes no
training step, LR-schedule step or optimizer state; its biases against a hand loop of the update rule over the
same batches' loads; data-parallel ranks agree with one process on the same global data; in-run choices that
would fall at or after the run's end are refused before training; the DeepSpeed path composes."""

from __future__ import annotations

import logging
import os
import socket
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from moe_lab.methods.base import MoELightningModule
from moe_lab.methods.condenser_module import CondenserModule
from tests.conftest import build_tiny, random_batch

G = 0.05


def _fit(module, tmp_path, max_steps, data, accumulate=1, callbacks=(), **kwargs):
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
                        accumulate_grad_batches=accumulate, num_sanity_val_steps=0, callbacks=list(callbacks),
                        **kwargs)
    trainer.fit(module, data if isinstance(data, DataLoader) else DataLoader(data, batch_size=None))
    return trainer


class _AtTrainStart(L.Callback):
    """What the run holds when training starts (after the pre-phase) and the LR of every micro-batch."""

    def __init__(self):
        self.start, self.lrs = {}, []

    def on_train_start(self, trainer, pl_module):
        self.start = {"step": trainer.global_step}
        layers = pl_module.patch.layers
        if hasattr(layers[0], "bias"):  # a condenser run
            self.start.update(bias=[layer.bias.clone() for layer in layers],
                              usage=[layer.usage.clone() for layer in layers],
                              forced=[layer.forced_experts for layer in layers],
                              updates=[int(layer.bias_updates) for layer in layers],
                              total_counts=[layer.total_counts.clone() for layer in layers],
                              grads=[p.grad for p in pl_module.parameters()])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_run_shorter_than_the_selection_chooses_condensers_and_trains_every_step(tmp_path, caplog):
    """3 optimizer steps of 2 micro-batches; the pre-phase makes 6 bias updates (12 micro-batches, 1.5 passes over
    the 8 batches) before step 0. Oracle for 'takes nothing from the run': an SFT run of the same loop has the
    same LR at every micro-batch and the same optimizer step count."""
    data = [random_batch(batch=2, seq=10, seed=s) for s in range(8)]
    optim, scheduler = {"lr": 1e-2}, {"name": "linear", "warmup_steps": 1}
    model = build_tiny("olmoe").eval()  # as from_pretrained returns it: the fit must still train in train mode
    module = CondenserModule(model, "condenser", options={"gamma": G, "n": 1, "selection_updates": 6},
                             optim=optim, scheduler=scheduler)
    before = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    seen = _AtTrainStart()
    with caplog.at_level(logging.INFO, logger="moe_lab.methods.condenser_module"):
        trainer = _fit(module, tmp_path / "c", 3, data, accumulate=2, callbacks=[seen])
    baseline_seen = _AtTrainStart()
    baseline = _fit(MoELightningModule(build_tiny("olmoe"), "sft", optim=optim, scheduler=scheduler),
                    tmp_path / "s", 3, data, accumulate=2, callbacks=[baseline_seen])
    assert trainer.global_step == baseline.global_step == 3 and seen.start["step"] == 0
    assert seen.lrs == baseline_seen.lrs and len(seen.lrs) == 6, "the LR schedule is the baseline's, step for step"
    steps = {int(s["step"]) for s in trainer.optimizers[0].state.values()}
    assert steps == {3}, "the optimizer stepped 3 times, none of them in the pre-phase"
    assert all(g is None for g in seen.start["grads"]), "the pre-phase computed no gradient"
    assert all(c.sum() == 0 for c in seen.start["total_counts"]), "training's routing statistics start at 0"
    assert all(f for f in seen.start["forced"]) and seen.start["updates"] == [6, 6]
    layers = module.patch.layers
    assert all(layer.forced_experts == f for layer, f in zip(layers, seen.start["forced"])), "chosen once"
    assert [int(layer.bias_updates) for layer in layers] == [9, 9], "6 pre-phase updates + 1 per optimizer step"
    for layer, start in zip(layers, seen.start["bias"]):  # training's loads move the other biases
        free = torch.ones_like(start, dtype=torch.bool)
        free[layer.forced_experts] = False
        assert not torch.equal(layer.bias[free], start[free]) and torch.equal(layer.bias[~free], start[~free])
    changed = [k for k, v in module.model.named_parameters() if not torch.equal(before[k], v)]
    assert len(changed) == len(before), "every weight trained"
    tokens = sum(int(b["attention_mask"].sum()) for b in data + data[:4])  # 12 micro-batches, cycling at 8
    line = [r.getMessage() for r in caplog.records if "chosen before step 0 by a forward-only" in r.getMessage()]
    assert len(line) == 1 and "6 bias updates, one per 2 micro-batch(es) per rank, over 12 micro-batches on 1 " \
        f"rank(s) = {tokens:,} tokens (1.50 passes over the training data)" in line[0]
    assert "training then runs all its steps from step 0" in line[0] and "layer 0 [" in line[0]


def test_pre_phase_biases_equal_a_hand_loop_over_the_same_batches(tmp_path):
    """Oracle: the routers' selected experts recorded during the pre-phase, bincounted over each batch's real
    tokens, grouped A = 3 micro-batches per update, b += gamma * -sign(mean - load) in float64, usage summed, then
    the n lowest (bias, usage) experts. Also: the pre-phase reads the loader's FIRST batches, in order."""
    updates, accumulate, n = 4, 3, 2
    data = [random_batch(batch=3, seq=9, seed=10 + s) for s in range(12)]
    module = CondenserModule(build_tiny("qwen3_moe"), "condenser",
                             options={"gamma": G, "n": n, "selection_updates": updates}, optim={"lr": 1e-3})
    records = {layer.index: [] for layer in module.patch.layers}
    ids_seen = []
    for view, layer in zip(module.patch.views, module.patch.layers):
        view.router.register_forward_hook(lambda m, a, out, i=layer.index: records[i].append(out[2].detach()))
    module.model.register_forward_pre_hook(lambda m, a, kw: ids_seen.append(kw["input_ids"].clone()),
                                           with_kwargs=True)
    seen = _AtTrainStart()
    _fit(module, tmp_path, 1, data, accumulate=accumulate, callbacks=[seen])
    micro = updates * accumulate
    for got, batch in zip(ids_seen[:micro], data[:micro]):
        assert torch.equal(got, batch["input_ids"])
    num_experts = module.patch.layers[0].num_experts
    for li, layer in enumerate(module.patch.layers):
        bias = torch.zeros(num_experts, dtype=torch.float64)
        usage = torch.zeros(num_experts, dtype=torch.float64)
        for u in range(updates):
            load = torch.zeros(num_experts, dtype=torch.float64)
            for m in range(u * accumulate, (u + 1) * accumulate):
                real = data[m]["attention_mask"].reshape(-1).bool()
                load += torch.bincount(records[layer.index][m][real].reshape(-1), minlength=num_experts).double()
            bias += G * -1.0 * torch.sign(load.mean() - load)
            usage += load
        torch.testing.assert_close(seen.start["bias"][li].double(), bias, rtol=0, atol=1e-7)
        assert torch.equal(seen.start["usage"][li], usage)
        lowest = sorted(range(num_experts), key=lambda e: (float(bias[e]), float(usage[e])))[:n]
        assert seen.start["forced"][li] == sorted(lowest)


def test_in_run_choice_at_or_after_the_end_is_refused_naming_the_numbers(tmp_path):
    """An epoch-based run: 2 epochs x 8 micro-batches / 4 accumulated = 4 optimizer steps."""
    data = [random_batch(batch=2, seq=8, seed=s) for s in range(8)]
    for updates, when in ((4, "be chosen after the last step and never train"), (9, "never be chosen")):
        module = CondenserModule(build_tiny("olmoe"), "condenser",
                                 options={"n": 1, "selection": "in_run", "selection_updates": updates})
        before = {k: v.detach().clone() for k, v in module.model.named_parameters()}
        with pytest.raises(ValueError) as err:
            _fit(module, tmp_path, -1, data, accumulate=4, max_epochs=2)
        msg = str(err.value)
        assert f"selection=in_run chooses the condensers after selection_updates={updates} bias updates, but " \
               "this run makes 4 (one per optimizer step: 4 optimizer steps)" in msg
        assert when in msg and "selection=pre_phase" in msg
        assert all(torch.equal(before[k], v) for k, v in module.model.named_parameters()), "refused before training"
    # one update per micro-batch (the public code's cadence): 16 updates, so 9 fits and is chosen in the run
    module = CondenserModule(build_tiny("olmoe"), "condenser", options={
        "n": 1, "selection": "in_run", "selection_updates": 9, "update_every": "micro_batch"})
    _fit(module, tmp_path, -1, data, accumulate=4, max_epochs=2)
    assert module.patch.layers[0].forced_experts and int(module.patch.layers[0].bias_updates) == 16


def test_default_condenser_under_deepspeed_zero3_runs_the_paper_protocol():
    """Config level (DeepSpeed needs GPUs under Lightning): `method=condenser model=olmoe hardware=deepspeed_zero3`
    composes to the paper's rule with the forward-only pre-phase, and the strategy preparation refuses nothing.
    The pre-phase's forwards go through the strategy's wrapped model (a real ZeRO-3 engine: the slow test below)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from moe_lab.runtime.strategies import build_strategy, prepare, strategy_kind
    from tests.conftest import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["method=condenser", "model=olmoe", "hardware=deepspeed_zero3"])
    options = OmegaConf.to_container(cfg.method.options)
    assert cfg.method._target_.endswith("CondenserModule") and cfg.method.aux_loss_coef == 0.0
    assert {k: options[k] for k in ("gamma", "n", "select", "budget", "bias_mode", "load", "selection",
                                    "condenser_bias", "update_every")} == {
        "gamma": 1e-4, "n": 2, "select": "lowest_bias", "budget": "replace", "bias_mode": "logit_selection",
        "load": "count", "selection": "pre_phase", "condenser_bias": "frozen", "update_every": "optimizer_step"}
    kwargs = OmegaConf.to_container(cfg.hardware.trainer, resolve=True)
    kwargs["accelerator"], kwargs["devices"] = "cpu", 1  # the device check would refuse GPUs here
    strategy = build_strategy(kwargs)
    assert strategy_kind(strategy) == "deepspeed_zero3"
    module = CondenserModule(build_tiny("olmoe"), "condenser", options={**options, "selection_updates": 2})
    prepare(SimpleNamespace(strategy=strategy, callbacks=[]), module)  # no refusal for the condenser
    assert module.patch.bias_updater.selection == "pre_phase" and module.patch.bias_updater.pending


_ZERO3 = '''
import os, sys
import torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from moe_lab.methods.condenser import run_selection_phase
from moe_lab.methods.condenser_module import CondenserModule
from tests.conftest import build_tiny, random_batch

deepspeed.init_distributed(dist_backend="gloo")
options = {"gamma": 0.05, "n": 2, "selection_updates": 3}
batches = [random_batch(batch=3, seq=9, seed=s) for s in range(6)]
results = {}
for mode in ("plain", "zero3"):
    module = CondenserModule(build_tiny("qwen3_moe"), "condenser", options=options)
    module.train()
    forward = module.selection_step
    if mode == "zero3":
        opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config={  # the LightningModule, as Lightning
            "train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True})
        forward = lambda b: _ForwardRedirection()(engine, module, "selection_step", b)
    report = run_selection_phase(module.patch, iter(batches), forward, 2)
    results[mode] = {"bias": [l.bias.clone() for l in module.patch.layers], "report": report,
                     "usage": [l.usage.clone() for l in module.patch.layers]}
torch.save(results, sys.argv[1])
'''


@pytest.mark.slow
def test_pre_phase_through_a_real_deepspeed_zero3_engine_equals_the_plain_forward(tmp_path):
    """DeepSpeed's own engine (CPU accelerator, gloo, one rank, ZeRO-3: parameters partitioned and gathered by the
    engine's hooks); the pre-phase's forward is Lightning's forward redirection through the engine, as
    CondenserModule does under DeepSpeedStrategy. Oracle: the same pre-phase calling the module directly."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = tmp_path / "zero3.py"
    script.write_text(_ZERO3)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out.pt"), str(_free_port())], env=env,
                          capture_output=True, text=True, timeout=900, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    plain, zero3 = out["plain"], out["zero3"]
    assert plain["report"] == zero3["report"] and plain["report"]["micro_batches"] == 6
    assert all(c for c in plain["report"]["condensers"].values())
    for a, b in zip(plain["bias"] + plain["usage"], zero3["bias"] + zero3["usage"]):
        assert torch.equal(a, b)
    assert any(b.abs().sum() > 0 for b in plain["bias"])


# --- data parallel: 2 processes (gloo) under Lightning's DDP strategy ------------------------------------------

DDP_OPTIONS = {"gamma": G, "n": 1, "selection_updates": 3}


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        row = {k: v[0] for k, v in random_batch(batch=1, seq=8, seed=100 + i, pad_rows=()).items()}
        row["input_ids"][0] = row["labels"][0] = 300 + i  # the row's id, read back from the model's input
        return row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _snapshot(module, seen, rows) -> dict:
    return {"bias": seen.start["bias"], "usage": seen.start["usage"], "forced": seen.start["forced"],
            "tokens": module.selection_report["tokens"], "micro_batches": module.selection_report["micro_batches"],
            "rows": rows}


def _condenser_reading_rows():
    """A condenser module and the list of row ids (first token of each row) its model forwards, in order."""
    module = CondenserModule(build_tiny("olmoe"), "condenser", options=DDP_OPTIONS, optim={"lr": 1e-3})
    rows = []
    module.model.register_forward_pre_hook(lambda m, a, kw: rows.append((kw["input_ids"][:, 0] - 300).tolist()),
                                           with_kwargs=True)
    return module, rows


def _ddp_worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    module, rows = _condenser_reading_rows()
    seen = _AtTrainStart()
    _fit(module, os.path.join(out_dir, "run"), 1, DataLoader(_Rows(), batch_size=2, shuffle=False), accumulate=2,
         callbacks=[seen], devices=world, strategy="ddp")
    torch.save(_snapshot(module, seen, rows[:6]), os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_ddp_pre_phase_biases_equal_across_ranks_and_one_process_on_the_global_batches(tmp_path):
    """Two ranks, 2 rows per micro-batch each (Lightning's DistributedSampler), 2 micro-batches per update. One
process reads the same 2-row micro-batches (rank 0's two of an update, then rank 1's two) with 4 per update: the
same global data per update in the same shapes. Loads are all-reduced, so biases, usage, condensers and the
token count are the same."""
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    flat = [row for r in (r0, r1) for batch in r["rows"] for row in batch]
    assert sorted(flat) == list(range(24)), "the ranks read disjoint shares"
    order = [row for u in range(3) for r in (r0, r1) for batch in r["rows"][2 * u:2 * u + 2] for row in batch]
    module, rows = _condenser_reading_rows()
    seen = _AtTrainStart()
    _fit(module, tmp_path / "one", 1, DataLoader(_Rows(), batch_size=2, sampler=order), accumulate=4,
         callbacks=[seen])
    one = _snapshot(module, seen, rows[:12])
    assert [row for batch in one["rows"] for row in batch] == order
    assert one["micro_batches"] == 12 and r0["micro_batches"] == r1["micro_batches"] == 12
    assert r0["tokens"] == r1["tokens"] == one["tokens"] == 3 * 8 * 8
    for key in ("bias", "usage"):
        for a, b, c in zip(r0[key], r1[key], one[key]):
            assert torch.equal(a, b) and torch.equal(a, c), key
    assert r0["forced"] == r1["forced"] == one["forced"] and all(one["forced"])
    assert any(b.abs().sum() > 0 for b in one["bias"])
