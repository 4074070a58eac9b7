"""A paper grid / pruning study killed or signalled keeps its finished points (issue 21 item 5): each point is in
points.csv (prune.csv) as it finishes; SIGUSR1/SIGTERM finish the point in hand and exit 128 + signum with how to
resume; a re-run into the same directory skips finished points and ends with the uninterrupted run's table."""

from __future__ import annotations

import os
import signal

import pandas as pd
import pytest
import torch

from moe_lab.compress import calibrate
from moe_lab.core.stamped_log import PointLog
from moe_lab.runs import compress_sweep as sweep
from moe_lab.runs.compress import compress
from moe_lab.runtime.stop_signal import Interrupted
from tests.compress.test_sweep import _cfg
from tests.conftest import random_batch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _common(tmp_path):
    from moe_lab.models import load_model

    tiny, _ = load_model(_cfg(tmp_path).model)
    cal = calibrate(tiny.eval(), [random_batch(batch=2, seq=16, pad_rows=())])
    cal.save(tmp_path / "cal.safetensors")
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 8)
    return [f"compress.calibration_file={tmp_path / 'cal.safetensors'}", f"compress.eval.path={tmp_path / 'text.txt'}",
            "compress.eval.max_length=64", "compress.eval.stride=64"]


def _signal_after(monkeypatch, n: int, signum: int):
    """Deliver ``signum`` to this process while the ``n``-th point is being written."""
    real, count = PointLog.append, []

    def append(self, row):
        count.append(row)
        if len(count) == n:
            os.kill(os.getpid(), signum)
        real(self, row)

    monkeypatch.setattr(PointLog, "append", append)


def _counting_ppl(monkeypatch) -> list:
    calls, real = [], sweep.ppl_point

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "ppl_point", counted)
    return calls


def _table(path):
    return pd.read_csv(path).drop(columns=["seconds"], errors="ignore")


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_signalled_grid_keeps_its_points_and_resumes_to_the_uninterrupted_table(signum, tmp_path, monkeypatch,
                                                                                capsys):
    common = _common(tmp_path)
    grid = [*common, "compress=paper_grid", "compress.grid.scores=[sf]", "compress.grid.groupings=[rr,rc]"]
    whole = compress(_cfg(tmp_path / "whole", *grid))
    assert whole["points"] == 12

    run = tmp_path / "run"
    _signal_after(monkeypatch, 5, signum)
    with pytest.raises(Interrupted) as stopped:
        compress(_cfg(run, *grid))
    assert stopped.value.code == 128 + signum
    assert "Resume with: the same command and hydra.run.dir=" in stopped.value.hint
    assert "finishing the point in hand" in capsys.readouterr().err
    assert len(pd.read_csv(run / "points.csv")) == 5 and not (run / "summary.json").exists()
    monkeypatch.undo()

    calls = _counting_ppl(monkeypatch)
    resumed = compress(_cfg(run, *grid))
    assert len(calls) == 12 - 5  # finished points are skipped
    pd.testing.assert_frame_equal(_table(run / "points.csv"), _table(tmp_path / "whole" / "points.csv"))
    assert (run / "grid.md").read_text() == (tmp_path / "whole" / "grid.md").read_text()
    assert resumed["best_per_pair"] == whole["best_per_pair"]

    with pytest.raises(ValueError, match=r"points.csv holds points measured with other settings \(eval.max_length: "
                                         r"64 -> 48, max_length: 64 -> 48, stride: 64 -> 48\).*delete that file"):
        compress(_cfg(run, *grid, "compress.eval.max_length=48"))


def test_a_point_that_dies_leaves_the_finished_ones_and_the_prune_study_resumes(tmp_path, monkeypatch):
    common = [*_common(tmp_path), "compress=prune", "compress.sweep=true", "compress.prune.strategy=small_moe",
              "compress.prune.values=[6,4,2]"]
    compress(_cfg(tmp_path / "whole", *common))
    run = tmp_path / "run"
    real, seen = sweep.prune_experts, []

    def dies_at_the_third(*args, **kwargs):  # a kill -9 in the middle of the third pruned model
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "prune_experts", dies_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        compress(_cfg(run, *common))
    assert pd.read_csv(run / "prune.csv").n_keep.tolist() == [8, 6, 4]  # the base row and two finished points
    monkeypatch.undo()
    calls = _counting_ppl(monkeypatch)
    compress(_cfg(run, *common))
    assert len(calls) == 1
    pd.testing.assert_frame_equal(_table(run / "prune.csv"), _table(tmp_path / "whole" / "prune.csv"))


def test_a_grid_rerun_after_its_calibration_was_rewritten_is_refused(tmp_path):
    """Issue 32 item 7: a calibration rewritten at the same path (other data) mixed old points with new ones,
    silently (the stamp held its path only)."""
    from moe_lab.models import load_model

    common = _common(tmp_path)
    grid = [*common, "compress=paper_grid", "compress.grid.scores=[sf]", "compress.grid.groupings=[rr]"]
    run = tmp_path / "run"
    compress(_cfg(run, *grid))
    tiny, _ = load_model(_cfg(tmp_path).model)
    calibrate(tiny.eval(), [random_batch(batch=2, seq=16, pad_rows=(), seed=1)]).save(tmp_path / "cal.safetensors")
    with pytest.raises(ValueError, match=r"points.csv holds points measured with other settings "
                                         r"\(calibration_contents: '[0-9a-f]{16}' -> '[0-9a-f]{16}'\)"):
        compress(_cfg(run, *grid))
