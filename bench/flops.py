"""FLOPs each method's training step really executes, counted, next to the analytic floor.

One line per method: ``method=<name> executed_gflop=<counted> floor_gflop=<analytic> ratio=<executed / floor>``,
then ``uncounted_ops=<names>`` if an op that may carry GEMM work had no counting rule (then the count is low).
Counted with ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward of the loss (an optimizer
step has no matmuls), plus rules registered here for the GEMM ops it does not know: ``aten._grouped_mm`` (HF's
default ``grouped_mm`` experts and moe-lab's grouped paths) and CPU flash attention (forward and backward).

Model: OLMoE widths (hidden 2048, expert width 1024, 64 experts top-8, 16 heads), random weights, reduced to
``--layers`` decoder layers, a ``--vocab`` vocabulary and one sequence of ``--tokens`` tokens so it runs on CPU
in a minute or two. Target: sft and densemixer within 5% of the floor (0.95 <= ratio <= 1.05).

Analytic floor, matmul FLOPs (2 per multiply-add). N tokens in sequences of S, L MoE layers, hidden h, attention
width a (query heads x head dim), key/value width c, expert width i, E experts, top-k, vocabulary V. Per token and
layer, forward: P = 2h (2a + 2c) (q, k, v, o projections), A = 4 S a (scores and values: the full S x S square the
SDPA kernels compute), R = 2hE (router), X = 6hi (one (token, expert) pair: gate, up, down); head = 2hV per token.

- sft, condenser (budget=replace: still k experts per token): F = 3 N [L (P + A + R + k X) + head]
  (backward = 2 x forward: input and weight gradients)
- frozen_router: F - 2 N L hE (no router weight gradient)
- densemixer (straight-through; paper_eq15 and the dense-forward ablation cost the same):
  F + N L (E - k) X (every inactive (token, expert) pair once, forward only, without autograd)
- compressed_experts (form=input, k_m = k / 2 main experts): 3 N [L (P + A + R + k_m X + 2Eh) + head]
  (2Eh: the per-token input scale, [N, E] auxiliary weights x [E, h] vectors)
- esft (experts 0..3 trained in every layer; f_l = share of layer l's routed pairs that go to them, measured):
  N [2 head + sum_l (m_l (P + R) + (m_l + 1 if l else 1) A + k X (m_l + f_l))], m_l = 1 if l = 0 else 2
  (only the selected experts train: layer 0's attention and router need no gradient, the later ones input
  gradients only; frozen experts' pairs need no weight gradient)

Executed exceeds the floor where a kernel recomputes: CPU flash attention's backward recomputes the scores (one
more S x S product, A / 4 per token and layer).

    python bench/flops.py [--layers 1] [--tokens 128] [--threads 2] [--methods sft,densemixer,...]

About 2 minutes and 5 GiB on 2 CPU threads with the defaults (most of it building each method's 1.7B-parameter
one-layer model and its first gradients); ``--layers 2`` doubles both (then esft's later-layer terms show too).
"""

from __future__ import annotations

import argparse
import collections
import gc

import torch
import transformers
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

import moe_lab

OLMOE_WIDTHS = {"hidden_size": 2048, "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
                "num_attention_heads": 16, "num_key_value_heads": 16, "norm_topk_prob": False}
ESFT_EXPERTS = 4  # experts per layer ESFT trains here
METHODS = ("sft", "frozen_router", "densemixer", "densemixer_ablation", "condenser", "compressed_experts", "esft")
GEMM_WORDS = ("mm", "matmul", "linear", "attention", "conv", "einsum")


def method_options(name: str, layers: list[int]) -> tuple[str, dict]:
    """(registered method, options) of a bench method name."""
    return {
        "densemixer_ablation": ("densemixer", {"forward": "dense", "gradient": "conventional"}),
        "condenser": ("condenser", {"n": 2, "experts": {i: [0, 1] for i in layers}}),
        "esft": ("esft", {"experts": {i: list(range(ESFT_EXPERTS)) for i in layers}}),
    }.get(name, (name, {}))


def grouped_mm_flop(mat_a, mat_b, offs=None, *args, out_val=None, **kwargs) -> int:
    """aten._grouped_mm: 2 x (output entries) x (contraction), over the rows ``offs`` covers (rows past
    ``offs[-1]`` are skipped by the kernel). 2-D x 3-D: jagged rows; 2-D x 2-D: jagged contraction (weight
    gradients); 3-D x 2-D: jagged columns; 3-D x 3-D: a batch."""
    end = int(offs[-1]) if offs is not None else None
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        return 2 * end * mat_a.shape[1] * mat_b.shape[2]
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * mat_a.shape[0] * end * mat_b.shape[1]
    if mat_a.dim() == 3 and mat_b.dim() == 2:
        return 2 * mat_a.shape[1] * mat_a.shape[2] * end
    return 2 * mat_a.shape[0] * mat_a.shape[1] * mat_a.shape[2] * mat_b.shape[2]


grouped_mm_flop._get_raw = True


def cpu_flash_attention_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def cpu_flash_attention_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


EXTRA_RULES = {torch.ops.aten._grouped_mm: grouped_mm_flop,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_attention_flop,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_flash_attention_backward_flop}


class UncountedOps(TorchDispatchMode):
    """Names of dispatched ops that look like GEMM work but have no counting rule."""

    def __init__(self, known):
        super().__init__()
        self.known, self.names = known, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        if packet not in self.known and any(w in packet.__name__ for w in GEMM_WORDS):
            self.names[packet.__name__] += 1
        return func(*args, **(kwargs or {}))


def floor_flops(name: str, config, tokens: int, seq: int, trained_fraction: list[float]) -> float:
    """The analytic floor of the module docstring."""
    h, i, e, k = config.hidden_size, config.intermediate_size, config.num_experts, config.num_experts_per_tok
    layers, vocab = config.num_hidden_layers, config.vocab_size
    head_dim = h // config.num_attention_heads
    a, c = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    proj, attn, router, pair, head = 2 * h * (2 * a + 2 * c), 4 * seq * a, 2 * h * e, 6 * h * i, 2 * h * vocab
    sft = 3 * tokens * (layers * (proj + attn + router + k * pair) + head)
    if name in ("sft", "condenser"):
        return sft
    if name == "frozen_router":
        return sft - tokens * layers * router
    if name in ("densemixer", "densemixer_ablation"):
        return sft + tokens * layers * (e - k) * pair
    if name == "compressed_experts":
        return 3 * tokens * (layers * (proj + attn + router + (k // 2) * pair + 2 * e * h) + head)
    if name == "esft":
        total = 2 * head
        for layer, fraction in enumerate(trained_fraction):
            m = 1 if layer == 0 else 2
            total += m * (proj + router) + (m + 1 if layer else 1) * attn + k * pair * (m + fraction)
        return tokens * total
    raise ValueError(f"no analytic floor for method {name!r}; methods: {', '.join(METHODS)}")


def count_step(name: str, config, ids: torch.Tensor) -> tuple[float, float, collections.Counter]:
    """(executed FLOPs of one forward + backward, analytic floor, uncounted GEMM-like ops) of method ``name``."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    layers = list(range(config.num_hidden_layers))
    method, options = method_options(name, layers)
    patch = moe_lab.apply(model, method, **options)
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=EXTRA_RULES)
    with counter, UncountedOps(set(flop_counter.flop_registry) | set(EXTRA_RULES)) as uncounted:
        model(input_ids=ids, labels=ids).loss.backward()
    counts = patch.counts().double()
    fraction = (counts[:, :ESFT_EXPERTS].sum(1) / counts.sum(1)).tolist()
    floor = floor_flops(name, config, ids.numel(), ids.shape[1], fraction)
    del model, patch
    gc.collect()
    return float(counter.get_total_flops()), floor, uncounted.names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--widths", default="", help="overrides of the OLMoE widths, e.g. hidden_size=64,num_experts=8")
    args = parser.parse_args(argv)
    names = args.methods.split(",")
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        parser.error(f"--methods: no analytic floor for {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    torch.set_num_threads(args.threads)
    widths = {**OLMOE_WIDTHS, **{k: int(v) for k, v in (w.split("=") for w in args.widths.split(",") if w)}}
    config = transformers.OlmoeConfig(vocab_size=args.vocab, num_hidden_layers=args.layers, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, max_position_embeddings=max(args.tokens, 16),
                                      **widths)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    print(f"bench=flops config=olmoe(h{config.hidden_size},i{config.intermediate_size},E{config.num_experts},"
          f"k{config.num_experts_per_tok},L{args.layers},V{args.vocab}) tokens={args.tokens}")
    results = {}
    for name in names:
        executed, floor, uncounted = count_step(name, config, ids)
        results[name] = executed / floor
        print(f"method={name} executed_gflop={executed / 1e9:.2f} floor_gflop={floor / 1e9:.2f} "
              f"ratio={executed / floor:.3f}")
        if uncounted:
            print(f"method={name} uncounted_ops={','.join(sorted(uncounted))}")
    return results


if __name__ == "__main__":
    main()
