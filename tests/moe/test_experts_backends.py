"""``model.experts_implementation``: every family's patched model equals vanilla HF on each of transformers' CPU
experts kernels, every method trains on each kernel it follows, and the rest is refused by name.

Oracle: vanilla HF on the SAME kernel (``set_experts_implementation``), forward and every parameter gradient with
``torch.equal`` (grouped_mm, the default, for every variant in test_conformance.py). One thread: ``batched_mm``
gathers the expert weights per (token, slot) pair and its backward scatters the pairs' weight gradients back with
an accumulating index_put, which sums in thread order on CPU (vanilla against its own copy differs in the last
bits with 2 threads, never with 1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hydra import compose, initialize_config_dir

import moe_lab
from moe_lab.methods.registry import refuse_method_backend
from moe_lab.models import load_model
from moe_lab.moe.experts_backend import set_experts_implementation
from tests.conftest import ALL_FAMILIES, ROOT, build_tiny, random_batch
from tests.moe.test_conformance import _assert_equal, _forward_backward

CPU_KERNELS = ("eager", "batched_mm", "grouped_mm")


def _kernel_model(family: str, kernel: str):
    model = build_tiny(family)
    set_experts_implementation(model, kernel)
    return model


def _kernel_families(kernel: str) -> list[str]:
    """The families whose experts can switch kernels (Llama 4 and DBRX have one implementation: refused below)."""
    return [f for f in ALL_FAMILIES if f not in ("llama4_text", "dbrx")] if kernel != "grouped_mm" else []


@pytest.mark.parametrize("kernel,family", [(k, f) for k in ("eager", "batched_mm") for f in _kernel_families(k)])
def test_sft_equals_vanilla_on_the_same_kernel(kernel, family, one_thread):
    vanilla = _kernel_model(family, kernel)
    ours = copy.deepcopy(vanilla)
    moe_lab.apply(ours, "sft")
    assert ours.config._experts_implementation == kernel
    vanilla.train()
    ours.train()
    batch = random_batch()
    ref, got = _forward_backward(vanilla, batch), _forward_backward(ours, batch)
    _assert_equal(got.logits, ref.logits, "logits")
    grads = dict(vanilla.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad is None) == (grads[name].grad is None), name
        if p.grad is not None:
            _assert_equal(p.grad, grads[name].grad, f"{kernel} {name}")


METHODS = [("sft", {}), ("frozen_router", {}), ("condenser", {}), ("densemixer", {}),
           ("sft", {"lora": {"rank": 2, "targets": ["experts"]}}),
           ("esft", {"experts": {0: [0, 1], 1: [2]}}), ("compressed_experts", {})]


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("method,options", METHODS, ids=lambda v: v if isinstance(v, str) else ",".join(v) or "-")
def test_every_method_trains_on_every_kernel_it_follows(method, options, kernel, one_thread):
    """A method that follows the kernel trains on it (a gradient reaches the experts, the forward equals sft's on
    that kernel where the method's forward is sft's); the two with their own grouped pass are refused elsewhere."""
    if method in ("esft", "compressed_experts") and kernel != "grouped_mm":
        with pytest.raises(ValueError, match=f"experts_implementation={kernel} with method {method}.*grouped_mm"):
            refuse_method_backend(method, kernel)
        return
    refuse_method_backend(method, kernel)
    model = _kernel_model("olmoe", kernel).train()
    reference = copy.deepcopy(model)
    moe_lab.apply(reference, "sft")
    patch = moe_lab.apply(model, method, **options)
    batch = random_batch()
    out = _forward_backward(model, batch)
    assert torch.isfinite(out.loss)
    trained = [p for view in patch.views for p in view.experts.parameters() if p.requires_grad]
    adapters = [p for n, p in model.named_parameters() if "lora" in n.lower() and p.requires_grad]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trained + adapters), method
    if method in ("sft", "frozen_router", "densemixer") and not options:  # forward = sft's, bit for bit
        _assert_equal(out.logits, _forward_backward(reference, batch).logits, f"{method} on {kernel}")


def test_the_setting_is_applied_and_checked_by_name(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny_olmoe", "model.experts_implementation=batched_mm"])
    model, _ = load_model(cfg.model)
    assert model.config._experts_implementation == "batched_mm"
    with pytest.raises(ValueError, match="model.experts_implementation=cutlass: choose one of eager, batched_mm"):
        set_experts_implementation(build_tiny("olmoe"), "cutlass")
    with pytest.raises(ValueError, match="Llama4ForCausalLM.*experts_implementation=null"):
        set_experts_implementation(build_tiny("llama4_text"), "batched_mm")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="experts_implementation=sonicmoe: .*Use grouped_mm"):
            set_experts_implementation(build_tiny("olmoe"), "sonicmoe")
    set_experts_implementation(model, None)  # null: transformers' choice, unchanged
    assert model.config._experts_implementation == "batched_mm"


def test_the_run_and_the_plan_refuse_a_method_on_a_kernel_it_ignores(tmp_path):
    import run

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=tiny_olmoe", "model.experts_implementation=eager", "method=compressed_experts", "debug=fast",
            "hardware=cpu", f"paths.output_dir={tmp_path}", "plan=true"])
    with pytest.raises(ValueError, match="experts_implementation=eager with method compressed_experts"):
        run.execute(cfg)
