"""Widened teacher routing (spec 2.9 / 2.15 item 17): k' = k reproduces the teacher; k' = E with the family's
renormalisation equals the full-softmax mixture; k' > E is refused. A dense teacher loads and distils (vanilla HF
logits; the fit step's gradient against an unchunked kd_loss)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import transformers
from torch.utils.data import DataLoader

from moe_lab.distill import widen_teacher
from moe_lab.moe.registry import config_value, family_spec, routing_size_paths
from tests.conftest import build_tiny, random_batch


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss", "olmoe", "phimoe",
                                    *(pytest.param(f, marks=pytest.mark.slow) for f in ("dbrx", "aria_text"))])
def test_k_prime_equal_k_is_the_teacher(family):
    model = build_tiny(family).eval()
    batch = random_batch()
    with torch.no_grad():
        ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        k = config_value(model.config, routing_size_paths(family_spec(family), model.config)[1])  # DBRX, Aria
        patch = widen_teacher(model, k)
        got = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(got, ref)
    patch.remove()


def test_k_prime_widens_and_full_set_is_softmax_mixture():
    model = build_tiny("qwen3_moe").eval()
    batch = {k: random_batch()[k] for k in ("input_ids", "attention_mask")}
    E = model.config.num_experts
    with torch.no_grad():
        base = model(**batch).logits
        patch = widen_teacher(model, 4)
        wide = model(**batch).logits
        patch.remove()
        patch = widen_teacher(model, E)  # family rule: renormalise over all E = the softmax itself
        family = model(**batch).logits
        patch.remove()
        patch = widen_teacher(model, E, weight_rule="raw")  # raw softmax p of every expert
        raw = model(**batch).logits
        patch.remove()
    assert not torch.allclose(wide, base, atol=1e-4)
    # the two differ only by dividing by sum(p) = 1 +- E ulp
    assert torch.allclose(family, raw, rtol=0, atol=1e-5)


def test_raw_rule_differs_for_a_renormalising_family_and_k_prime_checked():
    model = build_tiny("qwen3_moe").eval()
    batch = {k: random_batch()[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        patch = widen_teacher(model, 2)
        fam = model(**batch).logits
        patch.remove()
        patch = widen_teacher(model, 2, weight_rule="raw")
        raw = model(**batch).logits
        patch.remove()
    assert not torch.allclose(fam, raw, atol=1e-4)
    with pytest.raises(ValueError, match=r"teacher_top_k=9: layer 1 has 8 experts; choose 1 <= k' <= 8"):
        widen_teacher(model, 9)
    with pytest.raises(ValueError, match="teacher_weight_rule='p'"):
        widen_teacher(model, 2, weight_rule="p")


# ----------------------------------------------------------------------------------------------------------------
# A dense teacher (dense -> dense KD, e.g. distilling a converted student further)

DENSE_QWEN3 = {"vocab_size": 384, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
               "tie_word_embeddings": False}


def _dense(seed: int):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**DENSE_QWEN3))


class _FirstGrads(L.Callback):
    """The student's gradients of the first optimizer step, as the optimizer sees them."""

    grads = None

    def on_train_start(self, trainer, pl_module):
        def grab(opt, args, kwargs):
            if self.grads is None:
                self.grads = {n: p.grad.clone() for n, p in pl_module.model.named_parameters() if p.grad is not None}
        trainer.optimizers[0].register_step_post_hook(grab)


def test_dense_teacher_loads_and_distils_a_dense_student(tmp_path):
    """Oracle: vanilla ``AutoModelForCausalLM.from_pretrained`` teacher logits (bit-exact), and for the fit step
    the gradient of ``kd_loss`` (unchunked, full logits of a separately built student and the vanilla teacher)."""
    from moe_lab.data.tokenizer import load_tokenizer
    from moe_lab.distill import kd_loss, load_teacher
    from moe_lab.methods.distill import KDModule

    _dense(0).save_pretrained(tmp_path / "teacher")
    load_tokenizer("byte").save_pretrained(tmp_path / "teacher")
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "teacher").eval()
    batch = random_batch(batch=2, seq=10, pad_rows=((1, 4),))  # 10 + 6 real tokens
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        ref = vanilla(**inputs).logits
        for spec in (str(tmp_path / "teacher"), {"pretrained": str(tmp_path / "teacher"), "tokenizer": "byte"}):
            teacher = load_teacher(spec)
            assert teacher.config.model_type == "qwen3" and not teacher.training
            assert not any(p.requires_grad for p in teacher.parameters())
            assert torch.equal(teacher(**inputs).logits, ref)
    with pytest.raises(ValueError, match=r"teacher_top_k=2 widens an MoE teacher's routing, but the teacher is a "
                                         r"dense 'qwen3' model: set method.options.teacher_top_k=null"):
        widen_teacher(teacher, 2)

    module = KDModule(_dense(1), teacher=str(tmp_path / "teacher"), options={"chunk_size": 7}, optim={"lr": 1e-3})
    assert torch.equal(module.teacher(**inputs).logits, ref)
    grab = _FirstGrads()
    rows = [{k: v[i] for k, v in batch.items()} for i in range(2)]
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, max_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[grab])
    trainer.fit(module, train_dataloaders=DataLoader(rows, batch_size=2, shuffle=False))
    assert trainer.global_step == 1
    student = _dense(1)
    kd_loss(student(**inputs).logits, ref, kind="forward_kl", mask=batch["attention_mask"],
            normalizer=float(batch["attention_mask"].sum())).backward()
    hand = {n: p.grad for n, p in student.named_parameters() if p.grad is not None}
    assert set(grab.grads) == set(hand) and len(hand) == len(list(student.parameters()))
    for name, g in hand.items():
        # 16 tokens, chunks of 7 vs one pass: fp32 reordering ~ 16 * 1.2e-7 of the largest entry, x 5 margin
        scale = g.abs().max().item() + 1e-12
        assert torch.allclose(grab.grads[name], g, rtol=0, atol=1e-5 * scale), name
    assert torch.equal(module.teacher(**inputs).logits, ref)  # the teacher stays frozen


# ----------------------------------------------------------------------------------------------------------------
# paper_eq6 (alias raw): the paper's Eq. 6 weight p for every router kind, against a hand computation


def _hand_p(family: str, x: torch.Tensor, router) -> torch.Tensor:
    """p by hand in float64 from the router's parameters: softmax over all E of x W^T (+ b) for softmax and
    identity-score (GPT-OSS, its bias included) routers, 1 / (1 + exp(-x W^T)) for DeepSeek-V3's sigmoid router."""
    z = x.double() @ router.weight.double().T
    bias = getattr(router, "bias", None)
    if isinstance(bias, torch.Tensor):
        z = z + bias.double()
    if family == "deepseek_v3":
        return 1.0 / (1.0 + torch.exp(-z))
    e = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v2", "mixtral"])
@pytest.mark.parametrize("rule", ["paper_eq6", "raw"])
def test_paper_eq6_weights_are_p_over_all_experts(family, rule):
    from moe_lab.moe.routing import select_topk

    model = build_tiny(family).eval()
    patch = widen_teacher(model, 3, weight_rule=rule)
    view, policy = patch.views[0], patch.views[0].router.moe_lab_policy
    assert policy.weight_rule == "paper_eq6"
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, weights, indices = policy(view.router, x)
        fam_w, fam_i = select_topk(view.rule, logits, False, getattr(view.router, "e_score_correction_bias", None),
                                   top_k=3)
    patch.remove()
    assert torch.equal(indices, fam_i)  # the k'-set is the family's selection; only the weights change
    hand = _hand_p(family, x, view.router).gather(1, indices)
    assert torch.allclose(weights.double(), hand, rtol=0, atol=2e-6)  # fp32 softmax / sigmoid of O(1) logits
    if family in ("gpt_oss", "qwen3_moe", "deepseek_v3", "mixtral"):  # their own rule renormalises: Eq. 6 differs
        assert not torch.allclose(fam_w.double(), hand, atol=1e-3)


def test_paper_eq6_gpt_oss_block_output_is_the_p_weighted_sum():
    """The widened GPT-OSS teacher's MoE block output with paper_eq6 = sum over the top-k' logits of
    softmax_all(z)_e f_e(x) (float64 hand sum of the experts' outputs)."""
    from moe_lab.moe.experts import expert_forward

    model = build_tiny("gpt_oss").eval()
    patch = widen_teacher(model, 3, weight_rule="paper_eq6")
    view, block = patch.views[0], patch.layers[0]
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        flat = x.view(-1, x.shape[-1])
        p = _hand_p("gpt_oss", flat, view.router)
        z = flat.double() @ view.router.weight.double().T + view.router.bias.double()
        top = z.topk(3, dim=-1).indices
        hand = torch.zeros(flat.shape, dtype=torch.float64)
        for e in range(view.num_experts):
            chosen = (top == e).any(-1)
            hand += chosen[:, None] * p[:, e:e + 1] * expert_forward(view, e, flat).double()
    patch.remove()
    assert torch.allclose(out.reshape(flat.shape).double(), hand, rtol=0, atol=1e-5)


def test_unknown_weight_rule_names_both_choices():
    model = build_tiny("qwen3_moe").eval()
    with pytest.raises(ValueError, match="teacher_weight_rule='p': choose family .* or paper_eq6"):
        widen_teacher(model, 2, weight_rule="p")
