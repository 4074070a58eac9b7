"""task=condense keeps its search steps (issue 21 item 5): each greedy expert list (one per layer), greedy layer step
and single-layer loss is in search_progress.csv as it finishes; SIGTERM / SIGUSR1 finish the step in hand and exit
128 + signum with how to resume; a re-run into the same directory takes the finished steps (not recomputed) and
ends with the uninterrupted run's summary and export. Oracle: the uninterrupted run into another directory."""

from __future__ import annotations

import signal

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from moe_lab.compress import condense_search
from moe_lab.runtime.stop_signal import Interrupted
from moe_lab.tasks import run_task
from tests.compress.test_sweep_resume import _signal_after
from tests.conftest import ROOT, word_text

MODEL = ["model=tiny_olmoe", "model.config.num_hidden_layers=3"]  # 3 MoE layers, 2 condensed
PER_RUN = ("expert_search_s", "layer_search_s", "wall_time_s", "search_steps_reused", "search_progress", "export",
           "layer_loss_files")  # timings, and paths into the run's own directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("condense_resume")
    text = word_text(tmp / "c4.txt", 30)
    data = ["num_sequences=4", "seq_len=16", "batch_size=2", "sample=first"]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cal = run_task(compose("config", overrides=[
            f"paths.output_dir={tmp / 'cal'}", "task=calibrate", *MODEL,
            "dataset@compress.calibration.dataset=c4", f"compress.calibration.dataset.path={text}",
            *[f"compress.calibration.{d}" for d in data]]))["calibration"]
    common = ["task=condense", *MODEL, f"condense.calibration_file={cal}",
              f"condense.search.dataset.path={text}", "condense.routed_experts=2", "condense.num_layers=2",
              "condense.measure_speed=false", "condense.layer_loss_metrics=[js]", "condense.export=condensed",
              *[f"condense.search.{d}" for d in data]]
    return tmp / "whole", _run(tmp / "whole", common), common


def _run(out, common, *extra) -> dict:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.output_dir={out}", *common, *extra])
    return run_task(cfg)


def _comparable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in PER_RUN}


# (signal, saved steps when it arrives, expert searches and layer losses the re-run computes): uninterrupted, 3
# expert searches and 8 losses (greedy layer steps of 3 and 2 candidates, then 3 single-layer losses). SIGTERM
# through run.py (rc, the printed line): tests/runtime/test_signal_matrix.py
@pytest.mark.parametrize("signum,at,searches,losses_left", [(signal.SIGUSR1, 4, 0, 5)], ids=["in-layer-search"])
def test_signalled_condense_search_resumes_to_the_uninterrupted_result(setup, tmp_path, monkeypatch, capsys, signum,
                                                                       at, searches, losses_left):
    first, whole, common = setup
    steps = pd.read_csv(first / "search_progress.csv")
    # 3 expert lists (one per MoE layer), 2 greedy layer steps, 3 single-layer JS losses
    assert steps.stage.tolist() == ["experts"] * 3 + ["layers"] * 2 + ["single/js"] * 3

    run = tmp_path / "run"
    _signal_after(monkeypatch, at, signum)
    with pytest.raises(Interrupted) as stopped:
        _run(run, common)
    assert stopped.value.code == 128 + signum
    assert f"{at} finished search steps are in {run / 'search_progress.csv'}" in stopped.value.hint
    assert f"Resume with: the same command and hydra.run.dir={run}" in stopped.value.hint
    assert "finishing the point in hand of the condense search" in capsys.readouterr().err
    assert len(pd.read_csv(run / "search_progress.csv")) == at  # the step in hand finished and was saved
    assert not (run / "summary.json").exists() and not (run / "export").exists()
    monkeypatch.undo()

    searched, losses = [], []
    real_run, real_loss = condense_search.ExpertSearch.run, condense_search.LayerSearch.loss
    monkeypatch.setattr(condense_search.ExpertSearch, "run", lambda self, r: searched.append(1) or real_run(self, r))
    monkeypatch.setattr(condense_search.LayerSearch, "loss", lambda self, ls: losses.append(1) or real_loss(self, ls))
    resumed = _run(run, common)
    assert resumed["search_steps_reused"] == at
    assert (len(searched), len(losses)) == (searches, losses_left)  # finished steps are taken, not recomputed
    assert _comparable(resumed) == _comparable(whole)
    pd.testing.assert_frame_equal(pd.read_csv(run / "search_progress.csv"), steps)
    assert (run / "layer_losses.csv").read_text() == (first / "layer_losses.csv").read_text()
    a, b = load_file(run / "export" / "model.safetensors"), load_file(first / "export" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_killed_search_keeps_its_steps_and_other_settings_are_refused(setup, tmp_path, monkeypatch):
    common = setup[2]
    run = tmp_path / "run"

    def dies(self, *args, **kwargs):  # a kill -9 after the expert lists were saved
        raise KeyboardInterrupt

    monkeypatch.setattr(condense_search.LayerSearch, "greedy", dies)
    with pytest.raises(KeyboardInterrupt):
        _run(run, common)
    assert pd.read_csv(run / "search_progress.csv").stage.tolist() == ["experts"] * 3
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"search_progress.csv holds points measured with other settings "
                                         r"\(routed_experts: 2 -> 3\).*delete that file"):
        _run(run, common, "condense.routed_experts=3")
