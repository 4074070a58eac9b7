"""cd_sft_recipe=code ([CD-code]'s finetune, issue 18 item 11): optimiser / schedule values, the paper recipe
still the default, and ``loss_tokens=all`` = the CE over every position (prompt and padding included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_lab.compress import calibrate, condense, export_condensed
from moe_lab.methods.condense_sft import CondenseSFTModule
from tests.compress.test_condense_presets import _compose
from tests.conftest import build_tiny, random_batch


def test_code_recipe_values_and_paper_default():
    code = _compose("experiment=condense/deepseek_moe_sr_sft", "cd_sft_recipe=code").task
    assert (code.optim.lr, list(code.optim.betas), code.optim.weight_decay) == (1e-5, [0.9, 0.999], 0.01)
    assert (code.scheduler.name, code.scheduler.warmup_steps, code.scheduler.warmup_ratio) == ("linear", 0, 0.0)
    assert code.trainer.gradient_clip_val == 1.0
    paper = _compose("experiment=condense/deepseek_moe_sr_sft")
    assert (paper.task.optim.lr, paper.task.scheduler.name, paper.task.scheduler.warmup_ratio) == (1e-4, "cosine", 0.1)
    assert paper.method.options.loss_tokens == "response" and paper.method.master_weights == "fp32"


def test_loss_on_all_tokens_equals_ce_over_every_position(tmp_path):
    model = build_tiny("deepseek_v2").eval()
    cal = calibrate(model, [random_batch(3, 10)])
    export_condensed(condense(model, cal, [1], {1: [2, 0]}), tmp_path / "cd")
    batch = random_batch(3, 10, seed=4)
    batch["labels"][:, :4] = -100  # a prompt: not trained by the dataset's labels
    losses = {}
    for tokens in ("response", "all"):
        module = CondenseSFTModule(build_tiny("deepseek_v2"), options={"condensed": str(tmp_path / "cd"),
                                                                       "loss_tokens": tokens})
        module.eval()
        module.log = lambda *a, **k: None
        with torch.no_grad():
            losses[tokens] = float(module._step(dict(batch), "train"))
            logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ids = batch["input_ids"]
    want = F.cross_entropy(logits[:, :-1].double().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert abs(losses["all"] - float(want)) < 1e-5
    assert abs(losses["response"] - losses["all"]) > 1e-3
    with pytest.raises(ValueError, match="loss_tokens='prompt'"):
        CondenseSFTModule(build_tiny("deepseek_v2"), options={"condensed": str(tmp_path / "cd"),
                                                              "loss_tokens": "prompt"})


@pytest.mark.parametrize("recipe", ["code", "paper"])
def test_code_recipe_trains_every_token_without_master_weights_and_says_so(recipe, tmp_path, monkeypatch, capsys):
    """cd_sft_recipe=code sets, with no override on the command line, the public code's loss on every token and no
    fp32 master weights in both stages (LM epoch and task SFT) and says so in one line when the run starts; the
    paper recipe leaves the method's own (response tokens, fp32)."""
    from omegaconf import OmegaConf

    from moe_lab.tasks import cd_moe_sft as task

    condensed = tmp_path / "condensed"
    condensed.mkdir()
    (condensed / "condense_manifest.json").write_text("{}")
    cfg = _compose("experiment=condense/deepseek_moe_sr_sft", f"cd_sft_recipe={recipe}",
                   f"cd_sft.condensed={condensed}")
    OmegaConf.update(cfg, "paths.output_dir", str(tmp_path / "run"), force_add=True)
    stages = []
    monkeypatch.setattr(task, "finetune", lambda c: stages.append(c) or {"export": None})
    task.cd_moe_sft(cfg)
    want = ("all", "off") if recipe == "code" else ("response", "fp32")
    assert len(stages) == (2 if recipe == "code" else 1)  # the code recipe's LM epoch first
    assert all((s.method.options.loss_tokens, s.method.master_weights) == want for s in stages)
    lines = [line for line in capsys.readouterr().out.splitlines() if "cd_sft_recipe=" in line]
    assert len(lines) == 1 and lines[0].startswith("==== moe-lab cd_moe_sft: cd_sft_recipe=" + recipe)
    if recipe == "code":
        assert "loss on all tokens" in lines[0] and "master weights off" in lines[0]
