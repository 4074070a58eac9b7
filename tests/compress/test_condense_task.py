"""task=condense end to end on a tiny DeepSeek-V2 (calibrate -> search -> condense -> export -> reload)."""

from __future__ import annotations

from moe_lab.compress import Calibration, load_condensed
from tests.conftest import ROOT, word_text


def _compose(tmp_path, *overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"paths.output_dir={tmp_path}", *overrides])


def test_condense_task_searches_condenses_and_exports(tmp_path):
    from moe_lab.models import load_model
    from moe_lab.tasks import run_task

    text = word_text(tmp_path / "c4.txt", 30)
    data = ["num_sequences=4", "seq_len=16", "batch_size=2", "sample=first"]
    cal = run_task(_compose(tmp_path / "cal", "task=calibrate", "model=tiny_deepseek_v2",
                            "dataset@compress.calibration.dataset=c4", f"compress.calibration.dataset.path={text}",
                            *[f"compress.calibration.{d}" for d in data]))
    cfg = _compose(tmp_path / "cd", "task=condense", "model=tiny_deepseek_v2",
                   f"condense.calibration_file={cal['calibration']}", f"condense.search.dataset.path={text}",
                   "condense.routed_experts=2", "condense.num_layers=1", *[f"condense.search.{d}" for d in data])
    summary = run_task(cfg)
    model, _ = load_model(cfg.model)
    layer = summary["layers"][0]
    assert layer in (1, 2) and len(summary["experts"][str(layer)]) == 2
    E, I, H = 8, 32, 64
    removed = (E - 2) * 3 * I * H + E * H  # routed experts dropped + router
    total = sum(p.numel() for p in model.parameters())
    assert summary["params_before"] == total and summary["params_after"] == total - removed
    assert summary["export_format"] == "condensed"  # DeepSeek-V2: no per-layer dense FFN width
    back = load_condensed(summary["export"])
    assert back.get_submodule(f"model.layers.{layer}.mlp").expert_ids.tolist() == summary["experts"][str(layer)]
    Calibration.load(cal["calibration"]).check_compatible(model)
    # item 12: per-layer single-condensation losses (Figs. 2 / 5), active parameters, measured speed-up
    import csv

    rows = list(csv.DictReader((tmp_path / "cd" / "layer_losses.csv").read_text().splitlines()))
    assert [int(r["decoder_layer"]) for r in rows] == [1, 2] and set(rows[0]) >= {"js", "kl", "ppl"}
    js = {int(r["decoder_layer"]): float(r["js"]) for r in rows}
    # the greedy's first step IS the best single-layer condensation (same losses, same data)
    assert layer == min(js, key=lambda i: (js[i], i)) and abs(js[layer] - summary["layer_losses"][0]) < 1e-12
    assert (tmp_path / "cd" / "layer_losses.png").stat().st_size > 1000
    assert summary["active_params_before"] == total - 2 * (E - 2) * 3 * I * H  # 2 MoE layers, top-2 of 8
    assert summary["active_params_after"] == summary["active_params_before"] - E * H  # router gone, 2 = k kept
    assert summary["speedup"] > 0 and summary["speedup_device"] == "cpu"
