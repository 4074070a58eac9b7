"""task=offload: LRU fetches against an independent timestamp simulation, hand cases, the routing-log recorder
in a real Lightning run (counts = real tokens x k per step), refusal of another model's log, the task."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.analysis.offload import all_experts, fetches
from moe_lab.callbacks.routing_log import RoutingLogCallback, read_routing_log
from tests.callbacks.conftest import TinyModule, loader, random_batches
from tests.conftest import ROOT, tiny_model_cfg


def oracle(need, capacity, pins):
    """Timestamps: every needed expert is stamped (step, index) when used; after each stamp, the oldest stamps
    beyond capacity are evicted (the device holds at most capacity non-pinned experts at any time)."""
    steps, layers, _ = need.shape
    out = torch.zeros(steps, layers, dtype=torch.long)
    for layer in range(layers):
        stamp, seen_pins = {}, set()
        for s in range(steps):
            for e in need[s, layer].nonzero().flatten().tolist():
                if e in pins.get(layer, []):
                    out[s, layer] += e not in seen_pins
                    seen_pins.add(e)
                    continue
                out[s, layer] += e not in stamp
                stamp[e] = (s, e)
                for old in sorted(stamp, key=stamp.get)[: max(0, len(stamp) - capacity)]:
                    del stamp[old]
    return out


@pytest.mark.parametrize("capacity", [0, 2, 5, 16])
def test_lru_matches_the_timestamp_oracle(capacity):
    g = torch.Generator().manual_seed(capacity)
    need = torch.rand(40, 3, 16, generator=g) < 0.3
    pins = {0: [1, 2], 2: [7]}
    assert torch.equal(fetches(need, policy="lru", capacity=capacity, pinned=pins), oracle(need, capacity, pins))


def test_hand_cases():
    need = torch.zeros(3, 1, 4, dtype=torch.bool)
    need[0, 0, [0, 1]] = True
    need[1, 0, [1, 2]] = True
    need[2, 0, [0, 2]] = True
    # capacity 2: step0 fetch 0,1; step1 fetch 2 (evict 0); step2 fetch 0 (evict 1)
    assert fetches(need, policy="lru", capacity=2).flatten().tolist() == [2, 1, 1]
    # pinned 0, capacity 1: step0 fetch 0,1; step1 fetch 2 (evict 1); step2: 0 pinned, 2 resident
    assert fetches(need, policy="lru", capacity=1, pinned={0: [0]}).flatten().tolist() == [2, 1, 0]
    assert fetches(need, policy="all_resident", capacity=0).flatten().tolist() == [4, 0, 0]
    assert fetches(need, policy="lru", capacity=2, granularity="packed").flatten().tolist() == [4, 4, 4]
    assert fetches(all_experts(need), policy="lru", capacity=0).flatten().tolist() == [4, 4, 4]
    # DenseMixer: all E every step whatever capacity < E (scanning 0..3 through a cache of 3 misses every
    # time); with capacity E everything stays resident after the cold start
    for capacity in (1, 2, 3):
        assert fetches(all_experts(need), policy="lru", capacity=capacity).flatten().tolist() == [4, 4, 4]
    assert fetches(all_experts(need), policy="lru", capacity=4).flatten().tolist() == [4, 0, 0]
    # a pinned condenser is the only saving a sparse step needing more than capacity gets
    full = torch.ones(3, 1, 4, dtype=torch.bool)
    assert fetches(full, policy="lru", capacity=2, pinned={0: [1]}).flatten().tolist() == [4, 3, 3]
    with pytest.raises(ValueError, match="task.policy"):
        fetches(need, policy="fifo", capacity=1)


def _record(tmp_path, steps=4):
    batches = random_batches(steps)
    module = TinyModule()
    cb = RoutingLogCallback(path=tmp_path / "routing_log.jsonl", model_name="tiny_olmoe")
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb], accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(module, loader(batches))
    return batches, module


def test_recorder_counts_real_tokens_per_step(tmp_path):
    batches, module = _record(tmp_path)
    header, steps, counts = read_routing_log(tmp_path / "routing_log.jsonl")
    assert header["model"] == "tiny_olmoe" and header["model_type"] == "olmoe"
    assert steps == [1, 2, 3, 4]
    k = module.model.config.num_experts_per_tok
    for i, b in enumerate(batches):
        assert counts[i].sum(-1).tolist() == [int(b["attention_mask"].sum()) * k] * counts.shape[1]


def test_a_resumed_log_continues_the_checkpoints_run_in_a_new_directory(tmp_path):
    """Oracle: the uninterrupted run's log (every 2 steps of 4). Resumed from its step-3 checkpoint into another
    directory, the log is the same file: the header and step 2 come from the first run's log, step 4 counts steps
    3 and 4 (step 3's tokens, summed when the checkpoint was written, travel in it)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from moe_lab.data.resumable import ResumableDataLoader

    def fit(run, ckpt=None):
        cb = RoutingLogCallback(every_n_steps=2, path=run / "routing_log.jsonl", model_name="tiny_olmoe")
        saver = ModelCheckpoint(dirpath=run / "ckpt", every_n_train_steps=3, save_top_k=-1)
        trainer = L.Trainer(max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[cb, saver], accelerator="cpu", default_root_dir=run)
        trainer.fit(TinyModule(), ResumableDataLoader(random_batches(6), batch_size=None, shuffle=False),
                    ckpt_path=ckpt)

    fit(tmp_path / "a")
    (ckpt,) = (tmp_path / "a" / "ckpt").glob("*step=3.ckpt")
    fit(tmp_path / "b", str(ckpt))
    straight = (tmp_path / "a" / "routing_log.jsonl").read_text()
    assert [json.loads(line).get("step") for line in straight.splitlines()] == [None, 2, 4]
    assert (tmp_path / "b" / "routing_log.jsonl").read_text() == straight


def _cfg(tmp_path, model, logs, **task):
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    cfg = OmegaConf.create({"task": OmegaConf.load(ROOT / "conf" / "task" / "offload.yaml")["task"],
                            "model": tiny_model_cfg(model), "paths": {"output_dir": str(out)}, "logger": None})
    cfg.task.logs = logs
    for key, value in task.items():
        cfg.task[key] = value
    return cfg, out


def test_task_table_and_refusal(tmp_path):
    from moe_lab.tasks import run_task

    _record(tmp_path)
    log = str(tmp_path / "routing_log.jsonl")
    cfg, out = _cfg(tmp_path, "olmoe", {"sft": log, "condenser": log}, densemixer_from="sft", capacity=2,
                    condensers={0: [0, 1], 1: [2, 3]})
    summary = run_task(cfg)
    text = (out / "offload.md").read_text()
    assert "NOT realised" in text and "densemixer" in text
    # packed: every method fetches every expert: equal times
    packed = {k: v for k, v in summary.items() if "/packed/" in k}
    assert len(set(packed.values())) == 1
    # per-expert: DenseMixer needs all 8 experts of both layers every step; a cache of 2 keeps none of them, so
    # all 8 are fetched (not 8 - capacity)
    c = tiny_model_cfg("olmoe").config
    dm = 2 * 8 * 3 * c.hidden_size * c.intermediate_size * 2 / 25e9
    assert summary["offload/densemixer/expert/seconds_per_step"] == pytest.approx(dm, rel=1e-12)
    assert summary["offload/condenser/expert/seconds_per_step"] <= summary["offload/sft/expert/seconds_per_step"]
    assert (out / "offload.png").stat().st_size > 10_000
    cfg, _ = _cfg(tmp_path, "mixtral", {"sft": log})
    with pytest.raises(ValueError, match=r"task.logs.sft was recorded on tiny_olmoe .* model=tiny_mixtral"):
        run_task(cfg)
    rows = (out / "offload.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 * 2 * 4 and json.loads((out / "summary.json").read_text())


def test_a_densemixer_runs_log_is_counted_with_every_expert(tmp_path, capsys):
    """A routing log recorded by a DenseMixer run (its run directory's config.yaml says method.name=densemixer)
    counts top-k selections, but each of its steps computes all E experts: the offload model fetches all 8 per layer
    per step (the same log under an sft run directory stays sparse; it was counted sparse before, 6.9 of 8)."""
    from moe_lab.tasks import run_task

    _record(tmp_path)
    runs = {}
    for method in ("sft", "densemixer"):
        run = tmp_path / method
        run.mkdir()
        (run / "routing_log.jsonl").write_text((tmp_path / "routing_log.jsonl").read_text())
        OmegaConf.save({"method": {"name": method}}, run / "config.yaml")
        runs[method] = str(run / "routing_log.jsonl")
    cfg, _ = _cfg(tmp_path, "olmoe", runs, capacity=2)
    summary = run_task(cfg)
    assert "offload: task.logs.densemixer was recorded by a method=densemixer run: every expert is needed" \
        in capsys.readouterr().out
    c = tiny_model_cfg("olmoe").config
    assert summary["offload/densemixer/expert/seconds_per_step"] == pytest.approx(
        2 * 8 * 3 * c.hidden_size * c.intermediate_size * 2 / 25e9, rel=1e-12)
