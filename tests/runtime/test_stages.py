"""The stage protocol (moe_lab.runs.stage.run_stage): a stage runs in its folder with its config.yaml and leaves a
done-marker with its summary once it returns; a resumed run reuses it (paths moved with a copied run directory); a
stage that raised leaves no marker and runs again."""

from __future__ import annotations

import json
import shutil

import pytest
from omegaconf import OmegaConf

from moe_lab.runs.stage import STAGE_DONE, run_stage


def _cfg(out, resume=None):
    return OmegaConf.create({"paths": {"output_dir": str(out)}, "task": {"name": "toy", "resume": resume},
                             "model": {"name": "m"}, "logger": {"save_dir": "${paths.output_dir}"}})


def test_a_stage_runs_once_and_a_resume_reuses_it(tmp_path):
    calls = []

    def stage(cfg):
        calls.append(cfg)
        (tmp_path / "run" / "convert" / "export").mkdir(parents=True, exist_ok=True)
        return {"export": str(tmp_path / "run" / "convert" / "export"), "ppl": 3.5}

    run = tmp_path / "run"
    first = run_stage(_cfg(run), "convert", stage, **{"model.name": "student"})
    assert len(calls) == 1 and calls[0].logger.save_dir == str(run / "convert")  # interpolations follow the stage
    saved = OmegaConf.load(run / "convert" / "config.yaml")
    assert saved.model.name == "student" and saved.paths.output_dir == str(run / "convert")
    assert json.loads((run / "convert" / STAGE_DONE).read_text()) == {"folder": str(run / "convert"),
                                                                      "summary": first}
    assert run_stage(_cfg(run, resume=str(run)), "convert", stage) == first and len(calls) == 1
    run_stage(_cfg(run), "convert", stage)  # not a resume: the stage runs again
    assert len(calls) == 2
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    moved = run_stage(_cfg(copy, resume=str(copy)), "convert", stage)
    assert moved == {"export": str(copy / "convert" / "export"), "ppl": 3.5} and len(calls) == 2


def test_a_stage_that_raised_leaves_no_marker_and_resumes_from_its_checkpoint(tmp_path, caplog):
    import logging

    seen = []

    def failing(cfg):
        (tmp_path / "run" / "train" / "checkpoints").mkdir(parents=True)
        (tmp_path / "run" / "train" / "checkpoints" / "last.ckpt").write_bytes(b"x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_stage(_cfg(tmp_path / "run"), "train", failing)
    assert not (tmp_path / "run" / "train" / STAGE_DONE).exists()
    with caplog.at_level(logging.INFO, logger="moe_lab.runs.stage"):
        run_stage(_cfg(tmp_path / "run", resume=str(tmp_path / "run")), "train", lambda cfg: seen.append(cfg) or {})
    assert seen[0].task.resume == str(tmp_path / "run" / "train")  # the stage continues its own last.ckpt
    assert [r.getMessage() for r in caplog.records] == [
        (f"stage train: not finished in an earlier segment (no {STAGE_DONE}): it runs again in "
        f"{tmp_path / 'run' / 'train'}, continuing what it wrote there")]
    run_stage(_cfg(tmp_path / "other"), "train", lambda cfg: seen.append(cfg) or {})
    assert seen[1].task.resume is None
