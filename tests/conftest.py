"""Shared fixtures: tiny random models of every supported family, built from conf/model/tiny_*.yaml."""

from __future__ import annotations

import os
import socket
from collections import Counter
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n 2` on 2 cores: one thread per worker (and its subprocesses), set
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its pool; tiny models gain nothing from more

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from moe_lab.data.shipped import LLM_ADAPTERS_DIR

ROOT = Path(__file__).resolve().parents[1]
# the LLM-Adapters files: the copy shipped in the package unless $MOE_LAB_DATA_DIR names another
DATA_DIR = Path(os.environ.get("MOE_LAB_DATA_DIR", LLM_ADAPTERS_DIR))
# the core families: every test parametrised over families runs them by default
FAMILIES = [
    "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "mixtral", "phimoe",
]


def _added_families() -> list[str]:
    from moe_lab.moe.registry import supported_families

    return [f for f in supported_families() if f not in FAMILIES]


# every other registry family: the conformance suite (tests/moe) and the method x family tests (the `family`
# fixture: training, oracles, calibration, ...) run them in every run too; their cases are marked `slow`, so
# `-m "not slow"` keeps the core eight
ADDED_FAMILIES = _added_families()
ALL_FAMILIES = FAMILIES + ADDED_FAMILIES
FAMILY_PARAMS = [*FAMILIES, *(pytest.param(f, marks=pytest.mark.slow) for f in ADDED_FAMILIES)]

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_model_cfg(family: str, **config_overrides):
    """The conf/model/tiny_<family>.yaml entry, with optional HF-config overrides."""
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"tiny_{family}.yaml")
    for key, value in config_overrides.items():
        cfg.config[key] = value
    return cfg


def tiny_config(family: str, **config_overrides):
    """The HF config of conf/model/tiny_<family>.yaml, with optional overrides."""
    from moe_lab.models import build_config

    cfg = tiny_model_cfg(family, **config_overrides)
    return build_config(cfg.config_class, cfg.config)


def build_tiny(family: str, seed: int = 0, **config_overrides):
    """A tiny random HF model of ``family`` whose parameters are re-drawn with a larger scale so that
    routing is far from uniform (and the DeepSeek-V3 correction bias is non-zero)."""
    config = tiny_config(family, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                continue
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # selection-only biases
                b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
    return model


def method_families(method: str) -> tuple[list[str], dict[str, str]]:
    """(the supported families ``method`` is defined for, {family: reason} for those that refuse it), from each
    family's tiny config and :mod:`moe_lab.moe.support` (the check ``moe_lab.apply`` refuses by)."""
    from moe_lab.methods.registry import undefined_reason
    from moe_lab.models import build_config
    from moe_lab.moe.registry import family_spec, supported_families

    defined, refused = [], {}
    for name in supported_families():
        cfg = tiny_model_cfg(name)
        spec = family_spec(name)
        reason = undefined_reason(method, spec, spec.routing_rule(build_config(cfg.config_class, cfg.config)))
        if reason is None:
            defined.append(name)
        else:
            refused[name] = reason
    return defined, refused


def hf_router_output(spec, router, out):
    """``(logits, weights, indices)`` from a vanilla HF router's output ``out``: as returned, or, where the router
    returns ``(scores [N, E] (0 off the top-k), logits)`` (registry ``router_logits_index`` 1: Llama 4), the logits
    and the top-k of the scores."""
    if spec.router_logits_index != 1:
        return out
    scores, logits = out
    weights, indices = scores.topk(router.top_k, dim=-1)
    return logits, weights, indices


def hf_route(view, router, x):
    """The vanilla HF router's ``(logits, weights, indices)`` for tokens ``x`` [N, H], given what its block passes it:
    a selection bias the block holds itself (MiniMax-M2, LFM2-MoE, HY-V3, AFMoE); AFMoE's router reads [B, S, H]; Llama 4's
    returns (scores [N, E], logits), its top-k the nonzero scores; a router returning logits only leaves the top-k to
    its block's ``route_tokens_to_experts`` (DBRX)."""
    own = view.spec.correction_bias_attr
    extra = (getattr(view.block, own),) if own and "." not in own else ()
    if view.spec.router_logits_index:
        return hf_router_output(view.spec, router, router(x, *extra))
    try:
        out = router(x, *extra)
    except ValueError:  # AFMoE
        return tuple(t.reshape(-1, t.shape[-1]) for t in router(x[None], *extra))
    if isinstance(out, torch.Tensor):  # DBRX
        return (out, *view.block.route_tokens_to_experts(out))
    return out


def random_batch(batch: int = 3, seq: int = 10, seed: int = 0, pad_rows=((1, 3), (2, 5))):
    """input_ids/attention_mask/labels with left padding on some rows (row, n_pad)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for row, n_pad in pad_rows:
        if row < batch:
            ids[row, :n_pad] = 0
            mask[row, :n_pad] = 0
            labels[row, :n_pad] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def rehomed(model):
    """``model`` with every parameter and buffer copied into fresh (allocator-aligned) memory, ties kept.

    ``from_pretrained`` leaves CPU tensors as zero-copy views of the mmapped safetensors file, only 8-byte aligned.
    MKL's matrix-vector kernel (a Linear with one output: Qwen2-MoE's ``shared_expert_gate``) rounds differently on
    memory that is not 16-byte aligned on its SSE4.2 path (taken on some CPUs; ``MKL_ENABLE_INSTRUCTIONS=SSE4_2``
    forces it): bit-exact logits of a reload against an in-memory model compare like with like only after this."""
    with torch.no_grad():
        for p in model.parameters():  # each Parameter once: tied weights stay tied
            p.data = p.data.clone()
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.clone()
    return model


def assert_same_weights(reloaded, model) -> None:
    """Every tensor of ``reloaded`` has the dtype and the exact values of ``model``'s (same keys)."""
    want = model.state_dict()
    got = reloaded.state_dict()
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in got.items():
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key


def hf_fp32_names(model_type: str) -> tuple[str, ...]:
    """What transformers itself keeps in fp32 in a bf16/fp16 model of ``model_type``: its causal-LM class's
    ``_keep_in_fp32_modules_strict`` (DeepSeek-V3: the routing correction bias; from transformers 5.24 the router
    weight ``gate.weight`` too). A key is kept when it ends with one of them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return tuple(cls._keep_in_fp32_modules_strict or ())


WORDS = ["alpha", "beta", "gamma", "delta", "moe", "expert", "token", "layer", "dense"]


def word_text(path, lines: int, words_per_line: int = 40, seed: int = 0, vocab: int = 8):
    """Write ``lines`` lines of seeded random words (the first ``vocab`` of WORDS) to ``path``: local text for
    calibration / distillation tasks."""
    gen = torch.Generator().manual_seed(seed)
    words = WORDS[:vocab]
    path.write_text("\n".join(" ".join(words[int(i)] for i in torch.randint(0, vocab, (words_per_line,), generator=gen))
                              for _ in range(lines)))
    return path


@pytest.fixture(params=FAMILY_PARAMS)
def family(request):
    return request.param


def pytest_collection_modifyitems(config, items):
    """The files with the most `slow` tests first (stable order otherwise): under ``-n 2`` the long end-to-end
    files start at once instead of leaving one worker alone with them at the end (pyproject's
    ``--no-loadscope-reorder`` keeps pytest-xdist from re-sorting the files by their number of tests)."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture(scope="module")
def one_rank():
    """A one-process group for DeepSpeed's engine (gloo on CPU, NCCL on a GPU); destroyed, and the environment
    restored, after the test file (later tests' DDP subprocesses must not inherit its rank and port)."""
    import deepspeed

    port = free_port()
    saved = dict(os.environ)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    yield
    torch.distributed.destroy_process_group()
    from deepspeed.utils import groups

    deepspeed.comm.comm.cdb = None  # DeepSpeed's handles on the destroyed group: the next file's group starts anew
    groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    os.environ.clear()
    os.environ.update(saved)  # later tests' DDP subprocesses must not inherit this group's rank and port


@pytest.fixture
def one_thread():
    """torch on one thread for the test: float sums (bf16 matmuls, batched_mm's accumulating backward) then reduce in
    one order, so a run and its oracle, or two runs, can be compared bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def free_port() -> int:
    """A free TCP port on localhost (a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, *args, timeout: float = 600) -> None:
    """``target(rank, port, *args)`` in ``world`` spawned processes (torch's ``spawn`` start method) sharing one free
    rendezvous port; every one must exit 0."""
    import torch.multiprocessing as mp

    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout)
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
