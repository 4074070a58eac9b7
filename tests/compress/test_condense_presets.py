"""The CD-MoE paper presets follow [CD-code]'s protocol where the paper is silent (issue 18 items 8-10)."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT

PRESETS = ["deepseek_moe_s", "deepseek_moe_sr", "qwen1_5_moe_s", "qwen1_5_moe_sr"]


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("preset", PRESETS + [f"{p}_sft" for p in PRESETS])
def test_paper_presets_use_the_codes_readings(preset):
    cfg = _compose(f"experiment=condense/{preset}")
    c = cfg.condense
    assert c.hf_hidden_states is True  # A4-1: the last layer's expert search reads the post-norm state
    assert (c.search.sample, c.search.seq_len, c.search.num_sequences) == ("documents", 256, 100)
    assert c.gate_pass == "untruncated"
    assert c.alpha_hill_xmin == "peak"  # Fix-Finger, as the paper names it
    want = "deepseek_moe_16b" if preset.startswith("deepseek") else "qwen1_5_moe"
    assert cfg.model.name == want


def test_untruncated_gate_pass_needs_documents(tmp_path):
    from moe_lab.tasks.cd_moe_sft import _condense

    cfg = _compose("experiment=condense/deepseek_moe_sr_sft", "condense.search.sample=random",
                   f"paths.output_dir={tmp_path}")
    with pytest.raises(ValueError, match="search.sample=documents"):
        _condense(cfg, tmp_path)
    cfg = _compose("experiment=condense/deepseek_moe_sr_sft", "condense.gate_pass=whole",
                   f"paths.output_dir={tmp_path}")
    with pytest.raises(ValueError, match="condense.gate_pass='whole'"):
        _condense(cfg, tmp_path)
