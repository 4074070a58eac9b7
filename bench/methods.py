"""Per-step cost of every method relative to conventional SFT, next to its analytic FLOP ratio.

One line per method: ``method=<name> step_ratio=<median step / median sft step> cpu_ratio=<the same in
this process's CPU time> flop_ratio=<analytic, matmuls only>``. On a shared machine cpu_ratio with ``--threads 1`` is the
robust one (wall time there mostly measures waiting for a core).
Bench config: OLMoE-like, hidden 256, 16 experts top-4, 4 layers, batch 8 x 256 tokens; AdamW steps of
all methods are interleaved round-robin and medians compared, so machine noise hits all alike.
``densemixer_naive`` runs every expert with autograd (the baseline DenseMixer must beat).

Targets: densemixer <= 1.15 x its flop_ratio and below densemixer_naive; condenser <= 1.05;
esft within 5% of its flop_ratio (computed from the routing this run measured); compressed_experts
(k/2 main) <= 0.85.

    python bench/methods.py [--steps 10] [--threads 2] [--methods sft,densemixer,...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import transformers
from sft_step import train_step  # bench/ is on sys.path when run as `python bench/methods.py`

import moe_lab
from moe_lab.methods.base import sliced_weight_decay
from moe_lab.methods.densemixer import dense_weights
from moe_lab.methods.esft import slice_optimizer
from moe_lab.moe import find_moe_layers
from moe_lab.moe.aux_loss import native_aux_loss_coef
from moe_lab.moe.experts import expert_forward

BENCH_CONFIG = {
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 8, "num_experts": 16, "num_experts_per_tok": 4,
    "max_position_embeddings": 512, "norm_topk_prob": False,
}
BATCH, SEQ = 8, 256
ESFT_EXPERTS = 4  # experts per layer trained by ESFT in the bench (a typical p=0.1 token selection)


def naive_densemixer(block, x, logits, weights, indices):
    """Every expert with autograd: sparse value, straight-through router term, wasted expert backward."""
    out = block.experts(x, indices, weights)
    dense = dense_weights(block.view.obj.rule, logits, indices)
    inactive = torch.ones_like(dense, dtype=torch.bool).scatter_(1, indices, False)
    extra = sum(dense[:, e, None] * inactive[:, e, None] * expert_forward(block.view.obj, e, x)
                for e in range(block.num_experts))
    return out + (extra - extra.detach())


def flop_ratios(cfg: dict) -> dict[str, float]:
    """Analytic FLOPs of one step per method / SFT's (matmuls only; backward = 2 x forward, or 1 x where
    only input gradients are needed)."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    e, k, vocab = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["vocab_size"]
    attn = 2 * 4 * h * h + 2 * 2 * SEQ * h  # projections + scores/values (causal average ~ SEQ/2 x 2)
    expert = 2 * 3 * h * i
    router = 2 * h * e
    head = 2 * h * vocab
    other = layers * (attn + router) + head
    sft = 3 * (other + layers * k * expert)
    k_main = k // 2
    return {
        "sft": 1.0,
        "frozen_router": (sft - layers * router) / sft,
        "sft_native_aux": 1.0,
        "densemixer": (sft + layers * (e - k) * expert) / sft,
        "densemixer_naive": (sft + 3 * layers * (e - k) * expert) / sft,
        "condenser": 1.0,
        # uniform-routing estimate; main() replaces it by esft_flop_ratio on the run's measured routing
        "esft": esft_flop_ratio(cfg, [ESFT_EXPERTS / e] * layers),
        "compressed_experts": (3 * (other + layers * k_main * expert)) / sft,
    }


def esft_flop_ratio(cfg: dict, trained_fraction: list[float]) -> float:
    """ESFT step FLOPs / SFT's, matmuls only. ``trained_fraction[l]``: share of layer l's routed (token,
    expert) pairs that go to trained experts (the rest cost no weight gradient). Everything but the
    selected experts is frozen: lm_head, routers and attention projections need input gradients only (2 x;
    attention scores, which have no weights, 3 x as in SFT), and below layer 0's experts nothing needs a
    gradient (its attention and router: 1 x; its experts: forward + weight gradients, no input gradient)."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    e, k, vocab = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["vocab_size"]
    proj, scores, router = 2 * 4 * h * h, 2 * 2 * SEQ * h, 2 * h * e
    expert, head = 2 * 3 * h * i, 2 * h * vocab
    sft = 3 * (layers * (proj + scores + router) + head + layers * k * expert)
    esft = 2 * head
    for layer, fraction in enumerate(trained_fraction):
        first = layer == 0
        esft += (1 if first else 2) * (proj + router) + (1 if first else 3) * scores
        esft += k * expert * ((1 if first else 2) + fraction)
    return esft / sft


def build(method: str, base) -> torch.nn.Module:
    model = copy.deepcopy(base).train()
    # the MoE layer indices read off the base model: a patched deep copy would be a second model (7 GiB at OLMoE
    # widths) alive until the garbage collector breaks its view <-> block cycle, inside bench/mfu.py's peak window
    layers = [v.index for v in find_moe_layers(base)]
    if method == "densemixer_naive":
        patch = moe_lab.apply(model, "sft")
        for block in patch.layers:
            block.mixer = naive_densemixer
    elif method == "sft_native_aux":  # method=sft's loss: the family's own aux loss at its native coefficient
        patch = moe_lab.apply(model, "sft")
        patch.set_aux_loss_coef(native_aux_loss_coef(patch.spec, model.config))
    elif method == "esft":
        patch = moe_lab.apply(model, "esft", experts={i: list(range(ESFT_EXPERTS)) for i in layers})
    elif method == "condenser":
        patch = moe_lab.apply(model, "condenser", n=2, experts={i: [0, 1] for i in layers})
    else:
        patch = moe_lab.apply(model, method)
    model.moe_lab_patch = patch
    return model


def optimizer(model) -> torch.optim.Optimizer:
    """AdamW (lr 1e-5, weight decay 0.01) over the trainable parameters, grouped as the moe-lab Lightning
    module groups them: tensors trained only on some expert slices (ESFT) in a zero-decay group whose trained
    slices are decayed by ``sliced_weight_decay``, so no optimizer step has to copy and restore frozen slices;
    the ESFT module then lets AdamW step only the trained slices (``slice_optimizer``)."""
    masks = model.moe_lab_patch.expert_slice_masks
    sliced = {id(p) for p, _ in masks.values()}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) not in sliced], "weight_decay": 0.01},
              {"params": [p for p in params if id(p) in sliced], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-5)
    if masks:
        sliced_weight_decay(opt, masks.values(), 0.01)
        slice_optimizer(opt, model.moe_lab_patch)  # as ESFTLightningModule: step only the trained slices
    return opt


def step(model, optimizer, batch) -> tuple[float, float]:
    """One timed training step including the method's per-step hooks (e.g. condenser bias updates):
    (wall seconds, CPU seconds of this process)."""
    start, cpu = time.perf_counter(), time.process_time()
    train_step(model, optimizer, batch)
    model.moe_lab_patch.after_optimizer_step()
    return time.perf_counter() - start, time.process_time() - cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default="sft,frozen_router,sft_native_aux,esft,densemixer,densemixer_naive,"
                                             "condenser,compressed_experts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(transformers.OlmoeConfig(**BENCH_CONFIG))
    names = ["sft", *[m for m in args.methods.split(",") if m != "sft"]]
    available = set(moe_lab.supported_methods()) | {"sft_native_aux", "densemixer_naive"}
    skipped = [m for m in names if m not in available]
    names = [m for m in names if m in available]
    models = {m: build(m, base) for m in names}
    optimizers = {m: optimizer(models[m]) for m in names}
    ids = torch.randint(0, BENCH_CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    times, cpu_times = {m: [] for m in names}, {m: [] for m in names}
    for rep in range(args.warmup + args.steps):
        order = names if rep % 2 == 0 else names[::-1]
        for m in order:
            t = step(models[m], optimizers[m], batch)
            if rep >= args.warmup:
                times[m].append(t[0])
                cpu_times[m].append(t[1])
    flops = flop_ratios(BENCH_CONFIG)
    if "esft" in models:  # the FLOP ratio of the routing this run measured (routing counts of every step)
        patch = models["esft"].moe_lab_patch
        counts = patch.counts().double()
        trained = counts[:, :ESFT_EXPERTS].sum(1) / counts.sum(1)
        flops["esft"] = esft_flop_ratio(BENCH_CONFIG, trained.tolist())
    sft, sft_cpu = statistics.median(times["sft"]), statistics.median(cpu_times["sft"])
    print(f"bench=methods config=olmoe-like(h256,E16,k4,L4) batch={BATCH}x{SEQ} steps={args.steps} "
          f"sft_step_median_s={sft:.4f}")
    for m in names:
        print(f"method={m} step_ratio={statistics.median(times[m]) / sft:.3f} "
              f"cpu_ratio={statistics.median(cpu_times[m]) / sft_cpu:.3f} flop_ratio={flops[m]:.3f}")
    for m in skipped:
        print(f"method={m} skipped=not-installed")


if __name__ == "__main__":
    main()
