"""bench/flops.py: its grouped-matmul counting rule against per-group mm counted by torch's own rules, and the whole
bench at tiny widths (every method's executed FLOPs within 5% of the analytic floor, nothing left uncounted)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import flops as bench  # bench/flops.py


def _counted(fn) -> int:
    counter = FlopCounterMode(display=False, custom_mapping=bench.EXTRA_RULES)
    with counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("transposed_b", [False, True])
def test_grouped_mm_rule_equals_per_group_mm(transposed_b):
    """Forward (2-D x 3-D, jagged rows, rows past offs[-1] skipped) and its autograd backward (2-D x 2-D weight
    gradient, 2-D x 3-D input gradient) count as the same products done one group at a time with torch.mm."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 8, generator=gen, requires_grad=True)
    w = torch.randn(3, 12, 8, generator=gen) if transposed_b else torch.randn(3, 8, 12, generator=gen)
    w.requires_grad_(True)
    weight = w.transpose(1, 2) if transposed_b else w
    g = torch.randn(24, 12, generator=gen)
    offs = torch.tensor([5, 5, 20], dtype=torch.int32)  # 20 of 24 rows used
    grouped = _counted(lambda: (torch._grouped_mm(x, weight, offs) * g).sum().backward())
    bounds = [(0, 5), (5, 5), (5, 20)]
    looped = _counted(lambda: sum((x[a:b].mm(weight[i]) * g[a:b]).sum()
                                  for i, (a, b) in enumerate(bounds)).backward())
    assert grouped == looped == 3 * 2 * 20 * 8 * 12


def test_bench_at_tiny_widths(capsys):
    results = bench.main(["--layers", "2", "--tokens", "16", "--vocab", "256", "--threads", "1", "--widths",
                          "hidden_size=64,intermediate_size=32,num_attention_heads=4,num_key_value_heads=4"])
    out = capsys.readouterr().out
    assert set(results) == set(bench.METHODS) and "uncounted_ops" not in out, out
    for name, ratio in results.items():
        assert 1.0 <= ratio <= 1.05, (name, ratio, out)
    with pytest.raises(SystemExit):
        bench.main(["--methods", "sft,lora"])
    assert "--methods: no analytic floor for lora" in capsys.readouterr().err
