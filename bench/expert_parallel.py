"""The EP code path on one device (``hardware.ep_size`` machinery at EP size 1) against the plain moe-lab step.

One process group of one rank (NCCL on a CUDA GPU, gloo on the CPU). ``plain`` trains the bench model (bench/
sft_step.py's OLMoE-like config) with moe-lab's sft; ``ep`` the same model with its experts behind transformers'
``AllToAllEP`` (:func:`moe_lab.runtime.expert_parallel.install`, EP size 1: the all-to-all is a copy) and the ZeRO-1
composite optimizer (:class:`moe_lab.runtime.ep_optimizer.DenseShardedAdamW`). Both start from the same weights
and see the same batches; steps are interleaved and the medians compared, so machine noise hits both alike. Prints
the first step's loss difference (same weights: the EP path changes only the order of float sums), the last step's,
and ``step_ratio`` (ep / plain): what the dispatch costs where there is nothing to send. Issue 29's GPU item
(docs/scale-out.md): run it on a GPU, where multi-GPU EP throughput is still unmeasured.

    python bench/expert_parallel.py [--steps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import socket
import statistics

import torch
import transformers
from sft_step import (  # bench/ is on sys.path when run as `python bench/expert_parallel.py`
    BENCH_CONFIG,
    train_step,
)

import moe_lab
from moe_lab.runtime import expert_parallel
from moe_lab.runtime.ep_optimizer import DenseShardedAdamW


def _one_rank(device: str) -> None:
    """A one-rank process group on a free port (given to the store directly: no MASTER_* variable is left behind
    for later process groups of the same process, e.g. a test run's DDP)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                                         init_method=f"tcp://127.0.0.1:{port}")


def build(base, device: str, ep: bool):
    """(model, optimizer) of moe-lab sft on ``device``, its experts dispatched at EP size 1 when ``ep``."""
    model = copy.deepcopy(base).to(device).train()
    patch = moe_lab.apply(model, "sft")
    params = [p for p in model.parameters() if p.requires_grad]
    if not ep:
        return model, torch.optim.AdamW(params, lr=1e-4)
    state = expert_parallel.install(patch, 1, device)
    state.dense = "zero1"
    return model, DenseShardedAdamW([{"params": params}], state, lr=1e-4)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _one_rank(device)
    try:
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(transformers.OlmoeConfig(**BENCH_CONFIG))
        runs = {name: build(base, device, name == "ep") for name in ("plain", "ep")}
        gen = torch.Generator().manual_seed(1)
        times, losses = {name: [] for name in runs}, {name: [] for name in runs}
        for _ in range(args.steps + 1):  # the first step of each warms up and is not timed
            ids = torch.randint(0, BENCH_CONFIG["vocab_size"], (args.batch, args.seq), generator=gen).to(device)
            for name, (model, optimizer) in runs.items():
                seconds, loss = train_step(model, optimizer, {"input_ids": ids, "labels": ids}, device)
                times[name].append(seconds)
                losses[name].append(loss)
        first_diff = abs(losses["plain"][0] - losses["ep"][0])  # same weights: the forward's float sums alone
        last_diff = abs(losses["plain"][-1] - losses["ep"][-1])
        medians = {name: statistics.median(t[1:]) for name, t in times.items()}
        print(f"device={device} steps={args.steps} batch={args.batch}x{args.seq} "
              f"plain={medians['plain'] * 1e3:.1f}ms ep={medians['ep'] * 1e3:.1f}ms")
        # AdamW moves an entry by ~lr whatever its gradient's size, so rounding-level gradient differences of
        # near-zero entries grow into parameter differences of up to ~lr a step: the last loss differs by more
        print(f"first_loss_diff={first_diff:.3g} last_loss_diff={last_diff:.3g} (AdamW lr 1e-4)")
        print(f"step_ratio={medians['ep'] / medians['plain']:.3f}")
        return {"step_ratio": medians["ep"] / medians["plain"], "first_loss_diff": first_diff,
                "last_loss_diff": last_diff}
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
