"""RoutingDriftCallback: drift statistics against hand computations, the probe against vanilla HF routing,
the lr=0 invariant, a routing-changing method, resume and 2-process DDP."""

from __future__ import annotations

import math
import types

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from moe_lab.analysis.drift_stats import RoutingSnapshot, drift_means, drift_sums, routing_log_probs, snapshot
from moe_lab.callbacks import RoutingDriftCallback
from moe_lab.callbacks.routing_drift import capture_routing
from moe_lab.methods.base import MoELightningModule
from moe_lab.moe.routing import RoutingRule
from tests.conftest import build_tiny, random_batch

from .conftest import TinyModule, loader, metric_by_step, random_batches, read_csv_metrics

STATS = ("topk_overlap", "flip_rate", "top1_flip_rate", "entropy", "kl")


# drift statistics by hand ---------------------------------------------------------------------------
def test_drift_statistics_match_hand_computation():
    rule = RoutingRule(score="softmax", top_k=2, num_experts=4)
    mask = torch.tensor([1, 1, 1, 1, 0])  # the last token is padding: must not count
    base = snapshot(
        rule,
        logits=torch.zeros(5, 4),  # uniform routing distribution
        weights=torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.8, 0.2], [0.55, 0.45], [0.9, 0.1]]),
        indices=torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3], [0, 1]]),
        token_mask=mask,
    )
    now_logits = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0])).expand(5, 4).clone()
    now_logits[4] = torch.tensor([50.0, -50.0, 0.0, 0.0])
    now = snapshot(
        rule,
        logits=now_logits,
        weights=torch.tensor([[0.4, 0.6], [0.9, 0.1], [0.3, 0.7], [0.2, 0.8], [0.5, 0.5]]),
        indices=torch.tensor([[1, 0], [2, 1], [3, 1], [1, 3], [2, 3]]),
        token_mask=mask,
    )
    assert base.num_tokens == now.num_tokens == 4
    # sets {0,1}->{0,1}, {2,3}->{1,2}, {0,2}->{1,3}, {1,3}->{1,3}: overlaps 1, 1/2, 0, 1; two sets changed
    # top-1 (largest weight): 0->0, 3->2, 0->1, 1->3: three flips
    p = [0.1, 0.2, 0.3, 0.4]
    entropy = -sum(q * math.log(q) for q in p)
    kl = sum(0.25 * (math.log(0.25) - math.log(q)) for q in p)
    got = drift_means(drift_sums(base, now))
    assert got["topk_overlap"] == pytest.approx(0.625, abs=1e-12)
    assert got["flip_rate"] == pytest.approx(0.5, abs=1e-12)
    assert got["top1_flip_rate"] == pytest.approx(0.75, abs=1e-12)
    assert got["entropy"] == pytest.approx(entropy, rel=1e-6)
    assert got["kl"] == pytest.approx(kl, rel=1e-5)
    # against itself: nothing changed
    same = drift_means(drift_sums(base, base))
    assert (same["topk_overlap"], same["flip_rate"], same["top1_flip_rate"], same["kl"]) == (1.0, 0.0, 0.0, 0.0)
    assert same["entropy"] == pytest.approx(math.log(4), rel=1e-7)


def test_sums_add_over_ranks_like_one_union():
    rule = RoutingRule(score="softmax", top_k=2, num_experts=4)
    g = torch.Generator().manual_seed(0)

    def snap(n):
        logits = torch.randn(n, 4, generator=g)
        weights, indices = torch.softmax(logits, -1).topk(2)
        return snapshot(rule, logits, weights, indices)

    a0, a1, b0, b1 = snap(3), snap(5), snap(3), snap(5)
    union = drift_means(drift_sums(RoutingSnapshot.cat([a0, a1]), RoutingSnapshot.cat([b0, b1])))
    summed = drift_means(drift_sums(a0, b0) + drift_sums(a1, b1))
    assert union == pytest.approx(summed, rel=1e-12)


def test_appended_experts_lower_the_overlap():
    rule = RoutingRule(score="softmax", top_k=2, num_experts=8)
    base = snapshot(rule, torch.zeros(1, 8), torch.tensor([[0.6, 0.4]]), torch.tensor([[0, 1]]))
    now = snapshot(rule, torch.zeros(1, 8), torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0, 1, 5]]))
    got = drift_means(drift_sums(base, now))
    assert got["topk_overlap"] == pytest.approx(2 / 3) and got["flip_rate"] == 1.0
    assert got["top1_flip_rate"] == 0.0
    with pytest.raises(ValueError, match="different expert-set sizes"):
        RoutingSnapshot.cat([base, now])


def test_sigmoid_routing_distribution_is_normalised_gates():
    rule = RoutingRule(score="sigmoid", top_k=2, num_experts=3)
    logits = torch.tensor([[0.0, 1.0, -2.0]])
    gates = [1 / (1 + math.exp(-x)) for x in (0.0, 1.0, -2.0)]
    expected = [math.log(s / sum(gates)) for s in gates]
    assert routing_log_probs(rule, logits)[0].tolist() == pytest.approx(expected, rel=1e-6)


def test_drift_means_without_tokens_are_nan():
    assert all(math.isnan(v) for v in drift_means(torch.zeros(6, dtype=torch.float64)).values())


# the probe ------------------------------------------------------------------------------------------
def test_probe_matches_vanilla_hf_routing_counts_nothing_and_restores_modes():
    module = TinyModule()  # sft on tiny OLMoE: softmax top-2, no renormalisation
    module.train()
    attention = module.model.model.layers[0].self_attn
    attention.eval()  # a module deliberately left in eval mode must stay so
    batch = random_batches(1, batch=3, seq=10, seed=3)[0]
    counts = [layer.counts.clone() for layer in module.patch.layers]
    totals = [layer.total_counts.clone() for layer in module.patch.layers]
    flags = {name: m.training for name, m in module.named_modules()}

    snaps = capture_routing(module, [batch])

    assert all(torch.equal(a, b.counts) for a, b in zip(counts, module.patch.layers))
    assert all(torch.equal(a, b.total_counts) for a, b in zip(totals, module.patch.layers))
    assert flags == {name: m.training for name, m in module.named_modules()}
    assert module.model.training and not attention.training

    real = batch["attention_mask"].reshape(-1).bool()
    with module.patch.removed():
        module.model.eval()
        with torch.no_grad():
            router_logits = module.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True
            ).router_logits
    module.model.train()
    attention.eval()
    assert len(snaps) == len(router_logits) == 2
    for snap, logits in zip(snaps, router_logits):
        logits = logits[real]
        probs = torch.softmax(logits.double(), dim=-1)
        top = probs.topk(2, dim=-1)
        assert snap.num_tokens == int(real.sum())
        assert [set(r) for r in snap.indices.tolist()] == [set(r) for r in top.indices.tolist()]
        assert torch.equal(snap.top1, top.indices[:, 0])
        assert torch.allclose(snap.log_probs.double(), probs.log(), atol=1e-6)


def test_probe_works_on_every_family(family):
    import moe_lab

    model = build_tiny(family).train()
    holder = types.SimpleNamespace(model=model, patch=moe_lab.apply(model, "sft"))
    batch = random_batch()  # left-padded rows
    snaps = capture_routing(holder, [batch])
    assert model.training and len(snaps) == len(holder.patch.layers)
    for snap, layer in zip(snaps, holder.patch.layers):
        assert snap.num_tokens == int(batch["attention_mask"].sum())
        assert snap.indices.shape[1] == layer.top_k and int(snap.indices.max()) < layer.num_experts
        assert bool((snap.indices == snap.top1[:, None]).any(1).all())
        assert torch.allclose(snap.log_probs.double().exp().sum(1), torch.ones(snap.num_tokens, dtype=torch.float64),
                              atol=1e-5)
        same = drift_means(drift_sums(snap, snap))
        assert (same["topk_overlap"], same["flip_rate"], same["kl"]) == (1.0, 0.0, 0.0)


def test_packed_probe_counts_real_tokens_and_keeps_examples_apart():
    from moe_lab.data.packing import packed_collate

    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 4, 6))
    packed = packed_collate([[{"input_ids": a, "labels": a}, {"input_ids": b, "labels": b}],
                             [{"input_ids": c, "labels": c}]], pad_id=0)
    module = TinyModule()
    (layer0, layer1) = capture_routing(module, [packed])
    assert layer0.num_tokens == layer1.num_tokens == 15  # the 3 trailing pad tokens of row 1 are left out
    alone = capture_routing(module, [{"input_ids": torch.tensor([b]), "attention_mask": torch.ones(1, 4)}])
    for snap, ref in zip((layer0, layer1), alone):  # example b (tokens 5..8) routes as if it were alone
        assert [set(r) for r in snap.indices[5:9].tolist()] == [set(r) for r in ref.indices.tolist()]
        assert torch.allclose(snap.log_probs[5:9], ref.log_probs, atol=1e-5)


def _module(method="sft", lr=1e-3, **options):
    return MoELightningModule(build_tiny("olmoe"), method=method, options=options, optim={"lr": lr})


def _fit(module, tmp_path, callbacks, max_steps, val=True, train_batches=None, ckpt_path=None):
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=max_steps,
        callbacks=callbacks,
    )
    train = loader(train_batches or random_batches(max_steps))
    trainer.fit(module, train, loader(random_batches(2, seed=7)) if val else None, ckpt_path=ckpt_path)
    return trainer


def _csv_rows(tmp_path):
    (path,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    return read_csv_metrics(path)


def test_lr_zero_routing_is_exactly_unchanged_and_probes_count_nothing(tmp_path):
    module = _module("frozen_router", lr=0.0)
    batches = random_batches(4, seed=1)
    drift = RoutingDriftCallback(every_n_steps=2)
    _fit(module, tmp_path, [drift], max_steps=4, train_batches=batches)

    rows = _csv_rows(tmp_path)
    for name in ("topk_overlap", "flip_rate", "top1_flip_rate", "kl"):
        for key in (f"drift/layer0/{name}", f"drift/layer1/{name}", f"drift/{name}_mean"):
            values = metric_by_step(rows, key)
            assert sorted(values) == [1, 3], key  # optimizer steps 2 and 4; step 4 is also the end
            assert set(values.values()) == {1.0 if name == "topk_overlap" else 0.0}, key

    # the probe is the first validation batch; its entropy from vanilla HF router logits
    probe = random_batches(2, seed=7)[0]
    assert torch.equal(drift.probe[0]["input_ids"], probe["input_ids"])
    real = probe["attention_mask"].reshape(-1).bool()
    with module.patch.removed(), torch.no_grad():
        module.model.eval()
        out = module.model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"],
                           output_router_logits=True)
        # training-mode routing of the training batches = what the blocks should have counted
        expected = [torch.zeros(8, dtype=torch.long) for _ in module.patch.layers]
        for batch in batches:
            logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  output_router_logits=True).router_logits
            for i, layer_logits in enumerate(logits):
                keep = batch["attention_mask"].reshape(-1).bool()
                expected[i] += torch.bincount(layer_logits[keep].topk(2).indices.reshape(-1), minlength=8)
    for i, logits in enumerate(out.router_logits):
        p = torch.softmax(logits[real].double(), dim=-1)
        entropy = float(-(p * p.log()).sum(-1).mean())
        assert metric_by_step(rows, f"drift/layer{i}/entropy")[3] == pytest.approx(entropy, rel=1e-5)
    # probes (and validation) ran in eval mode: only the training batches were counted
    assert [layer.total_counts.tolist() for layer in module.patch.layers] == [e.tolist() for e in expected]


def test_condenser_bias_moves_the_sets_not_the_distribution(tmp_path):
    # lr = 0: only the router bias (selection only) and the forced condenser expert change routing
    module = _module("condenser", lr=0.0, gamma=0.5, n=1, selection="in_run", selection_updates=2)
    drift = RoutingDriftCallback(every_n_steps=0)  # only at the end
    _fit(module, tmp_path, [drift], max_steps=3)
    got = drift.latest
    assert got["step"] == 3
    for i in (0, 1):
        assert got[f"drift/layer{i}/topk_overlap"] < 1.0
        assert got[f"drift/layer{i}/flip_rate"] > 0.0
    # layer 0's router input (embeddings, attention) is unchanged and its bias enters selection only: same
    # distribution. Layer 1's input is layer 0's output, which the new selection changed.
    assert got["drift/layer0/kl"] == 0.0
    assert got["drift/layer1/kl"] > 0.0
    forced = [layer.forced_experts for layer in module.patch.layers]
    assert all(len(f) == 1 for f in forced)
    now = capture_routing(module, drift.probe)
    for snap, (expert,) in zip(now, forced):
        assert bool((snap.indices == expert).any(1).all())  # the condenser is in every token's set
    assert sorted(metric_by_step(_csv_rows(tmp_path), "drift/layer0/topk_overlap")) == [2]  # logged once


def test_without_validation_the_probe_is_the_first_training_batch(tmp_path):
    batches = random_batches(3, seed=11)
    drift = RoutingDriftCallback(every_n_steps=1)
    _fit(_module(lr=1e-2), tmp_path, [drift], max_steps=3, val=False, train_batches=batches)
    assert len(drift.probe) == 1
    assert torch.equal(drift.probe[0]["input_ids"], batches[0]["input_ids"])
    assert drift.baseline[0].num_tokens == int(batches[0]["attention_mask"].sum())
    values = metric_by_step(_csv_rows(tmp_path), "drift/topk_overlap_mean")
    assert sorted(values) == [0, 1, 2]
    assert all(0.0 <= v <= 1.0 for v in values.values())


def test_resume_keeps_the_base_models_probe_and_baseline(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    first = RoutingDriftCallback(every_n_steps=2)
    _fit(_module(lr=1e-2), tmp_path, [first, ckpt], max_steps=2)
    second, module = RoutingDriftCallback(every_n_steps=2), _module(lr=1e-2)
    _fit(module, tmp_path, [second, ModelCheckpoint(dirpath=tmp_path / "ckpt2")], max_steps=4,
         ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert torch.equal(second.probe[0]["input_ids"], first.probe[0]["input_ids"])
    for a, b in zip(first.baseline, second.baseline):
        assert all(torch.equal(x, y) for x, y in zip(a.to_dict().values(), b.to_dict().values()))
    # step 4 is measured against the base model of the first run, not the restored step-2 model
    assert second.latest["step"] == 4
    now = capture_routing(module, first.probe)
    for i, (base, cur) in enumerate(zip(first.baseline, now)):
        for name, value in drift_means(drift_sums(base, cur)).items():
            assert second.latest[f"drift/layer{i}/{name}"] == pytest.approx(value, rel=1e-12), name


def _rank_state(seed: int, tokens: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    snap = RoutingSnapshot(torch.randint(0, 4, (tokens, 2), generator=g), torch.randint(0, 4, (tokens,), generator=g),
                           torch.randn(tokens, 4, generator=g).log_softmax(-1))
    return {"probe": [{"input_ids": torch.full((1, tokens), seed)}], "baseline": [snap.to_dict(), snap.to_dict()]}


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (1, 0), (3, 2)])
def test_each_rank_continues_its_own_probe_of_a_ddp_checkpoint(world, rank):
    """A 2-rank checkpoint's drift state (every rank's probe and baseline): resumed on 2 ranks each rank takes its
    own; on another number of ranks every rank takes both (in rank order) and only rank zero's sums count."""
    ranks = [_rank_state(0, 3), _rank_state(1, 5)]
    callback = RoutingDriftCallback()
    callback.load_state_dict({"layers": [0, 1], "ranks": ranks})
    callback._own_probe(types.SimpleNamespace(world_size=world, global_rank=rank, is_global_zero=rank == 0))
    mine = [ranks[rank]] if world == 2 else ranks
    assert [b["input_ids"].tolist() for b in callback.probe] == [b["input_ids"].tolist() for r in mine
                                                                 for b in r["probe"]]
    for layer in range(2):
        expected = RoutingSnapshot.cat([RoutingSnapshot(**r["baseline"][layer]) for r in mine])
        for name, value in expected.to_dict().items():
            assert torch.equal(getattr(callback.baseline[layer], name), value), name
    assert callback._counts == (world == 2 or rank == 0)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="every_n_steps"):
        RoutingDriftCallback(every_n_steps=-1)
    with pytest.raises(ValueError, match="probe_batches"):
        RoutingDriftCallback(probe_batches=0)
    with pytest.raises(TypeError, match="input_ids"):
        capture_routing(TinyModule(), [[torch.zeros(2, 3, dtype=torch.long)]])


# 2-process DDP ------------------------------------------------------------------------------------------
DDP_OPTIONS = {"gamma": 0.5, "n": 1, "selection": "in_run", "selection_updates": 2}


class LazyCondenser(L.LightningModule):
    """Condenser on tiny OLMoE, built in each process (moe-lab's router classes do not pickle); lr = 0, so
    only the router biases (updated from all-reduced loads) and the condensers change the routing."""

    def __init__(self):
        super().__init__()
        self.model = self.patch = None

    def configure_model(self):
        if self.model is None:
            import moe_lab

            self.model = build_tiny("olmoe")
            self.patch = moe_lab.apply(self.model, "condenser", **DDP_OPTIONS)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.patch.after_optimizer_step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class DumpRankState(L.Callback):
    """Each rank saves its probe batch, final biases and condensers, its baseline routing of the probe and
    its routing of it now (what the drift callback compared at the last step), and its thread count."""

    def __init__(self, out_dir, drift):
        self.out_dir, self.drift = str(out_dir), drift

    def on_train_end(self, trainer, pl_module):
        now = capture_routing(pl_module, self.drift.probe, trainer.precision_plugin.val_step_context)
        torch.save(
            {"probe": self.drift.probe, "bias": [layer.bias.clone() for layer in pl_module.patch.layers],
             "forced": [layer.forced_experts for layer in pl_module.patch.layers],
             "baseline": [snap.to_dict() for snap in self.drift.baseline],
             "now": [snap.to_dict() for snap in now], "threads": torch.get_num_threads()},
            f"{self.out_dir}/rank{trainer.global_rank}.pt",
        )


def _assert_same_routing(got: RoutingSnapshot, expected: RoutingSnapshot, what: str):
    for name, value in expected.to_dict().items():
        assert torch.equal(getattr(got, name), value), f"{what}: {name}"


@pytest.mark.slow
def test_ddp_drift_is_that_of_the_union_of_rank_probes_and_rank_zero_writes(tmp_path):
    from moe_lab.analysis.bias_plots import BiasTrajectory
    from moe_lab.callbacks import RouterBiasCallback

    def rows_of(batches):
        return [{k: v[i] for k, v in b.items()} for b in batches for i in range(b["input_ids"].shape[0])]

    train = torch.utils.data.DataLoader(rows_of(random_batches(4, batch=2)), batch_size=2, shuffle=False)
    val = torch.utils.data.DataLoader(rows_of(random_batches(2, batch=2, seed=7)), batch_size=2, shuffle=False)
    drift = RoutingDriftCallback(every_n_steps=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=4, logger=CSVLogger(tmp_path),
        log_every_n_steps=1, default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
        callbacks=[drift, RouterBiasCallback(log_every_n_steps=1, record_every_n_steps=1, plot_every_n_steps=2),
                   DumpRankState(tmp_path, drift)],
    )
    trainer.fit(LazyCondenser(), train, val)

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    # each rank probes its shard of the first validation batch (rows 0, 2 and 1, 3 of the val set)
    val_rows = rows_of(random_batches(2, batch=2, seed=7))
    for r in (0, 1):
        expected = torch.stack([val_rows[r]["input_ids"], val_rows[r + 2]["input_ids"]])
        assert torch.equal(ranks[r]["probe"][0]["input_ids"], expected)
    assert not torch.equal(ranks[0]["probe"][0]["input_ids"], ranks[1]["probe"][0]["input_ids"])
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["bias"], ranks[1]["bias"]))
    assert ranks[0]["forced"] == ranks[1]["forced"] and all(len(f) == 1 for f in ranks[0]["forced"])

    # the logged drift is that of the union of both ranks' probes: the statistics of the ranks' own routings
    # (baseline and final), concatenated in one process. Both sides start from the same float32
    # log-probabilities; only the float64 summation order differs (rank sums added vs one sum over the
    # union): at most n_tokens * eps64 relative for these non-negative per-token terms, ~5e-15 here.
    def union_of(key):
        return [RoutingSnapshot.cat([RoutingSnapshot(**r[key][i]) for r in ranks]) for i in range(2)]

    base, now = union_of("baseline"), union_of("now")
    (metrics_csv,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    rows = read_csv_metrics(metrics_csv)
    for i, (b, n) in enumerate(zip(base, now)):
        for name, value in drift_means(drift_sums(b, n)).items():
            assert metric_by_step(rows, f"drift/layer{i}/{name}")[3] == pytest.approx(value, rel=1e-12), name

    # those routings are the base model's and the final biases' and condensers': one process routes the
    # union of the probes bit for bit as the ranks did. Same operations on the same inputs give the same bits
    # once the intra-op thread count is the ranks' (Lightning sets cpus // 2 in each spawned process; a
    # different count may split float32 reductions differently on some CPUs).
    import moe_lab

    assert ranks[0]["threads"] == ranks[1]["threads"]
    threads = torch.get_num_threads()
    torch.set_num_threads(ranks[0]["threads"])
    try:
        model = build_tiny("olmoe")
        patch = moe_lab.apply(model, "condenser", **DDP_OPTIONS)
        holder = types.SimpleNamespace(model=model, patch=patch)
        union = ranks[0]["probe"] + ranks[1]["probe"]
        for got, expected in zip(capture_routing(holder, union), base):
            _assert_same_routing(got, expected, "baseline")
        for layer, bias, forced in zip(patch.layers, ranks[0]["bias"], ranks[0]["forced"]):
            layer.bias.copy_(bias)
            layer.forced_expert_ids.copy_(torch.tensor(forced))
        for got, expected in zip(capture_routing(holder, union), now):
            _assert_same_routing(got, expected, "final routing")
    finally:
        torch.set_num_threads(threads)

    # rank zero alone wrote the bias trajectory; its last row holds the final biases
    plots = tmp_path / "plots"
    assert sorted(p.name for p in plots.iterdir()) == ["router_bias_trajectory.csv", "router_bias_trajectory.png"]
    traj = BiasTrajectory.from_csv(plots / "router_bias_trajectory.csv")
    assert traj.steps == [0, 1, 2, 3, 4] and traj.chosen_at == {0: 2, 1: 2}
    for index, bias in zip((0, 1), ranks[0]["bias"]):
        assert torch.equal(torch.from_numpy(traj.biases[index][-1]), bias)
