"""task=expert_removal signalled (issue 21 item 5): SIGTERM finishes the point in hand, exits 128 + signum with
how to resume; the same command again reuses the finished points' predictions (generates only the rest)."""

from __future__ import annotations

import os
import signal

import pytest
from omegaconf import OmegaConf

from moe_lab.compress.calibration import calibrate
from moe_lab.eval import generation
from moe_lab.models import load_model
from moe_lab.runtime.stop_signal import Interrupted
from moe_lab.tasks import expert_removal, run_task
from tests.conftest import DATA_DIR, ROOT, random_batch, tiny_model_cfg


def _cfg(tmp_path):
    batch = random_batch(batch=4, seq=16)
    model, _ = load_model(tiny_model_cfg("olmoe"))
    cal_path = calibrate(model, [{k: batch[k] for k in ("input_ids", "attention_mask")}]).save(tmp_path / "cal.st")
    ev = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "eval" / "_common.yaml"),
                         {"name": "math7", "datasets": ["gsm8k"], "limit": 1, "data_dir": str(DATA_DIR),
                          "generation": {"max_new_tokens": 2}, "device": "cpu"})
    cfg = OmegaConf.create({"task": OmegaConf.load(ROOT / "conf" / "task" / "expert_removal.yaml")["task"],
                            "model": tiny_model_cfg("olmoe"), "paths": {"output_dir": str(tmp_path / "run")},
                            "logger": None, "eval": ev, "seed": 0})
    cfg.task.update({"calibration_file": str(cal_path), "small_dense": [3], "inference_reduce": [1]})
    return cfg


def test_signalled_expert_removal_resumes_from_the_finished_points(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    real_eval, real_gen, calls, prompts = expert_removal._evaluate_export, generation.generate, [], []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # SLURM's warning while the first pruned point is evaluated
            os.kill(os.getpid(), signal.SIGTERM)
        return real_eval(*args, **kwargs)

    def counting(model, tokenizer, batch_prompts, **kw):
        prompts.extend(batch_prompts)
        return real_gen(model, tokenizer, batch_prompts, **kw)

    monkeypatch.setattr(expert_removal, "_evaluate_export", signalled)
    monkeypatch.setattr(generation, "generate", counting)
    with pytest.raises(Interrupted) as stopped:
        run_task(cfg)
    assert stopped.value.code == 128 + signal.SIGTERM and len(calls) == 2  # the point in hand finished
    assert "2 of 3 points finished" in stopped.value.hint and "hydra.run.dir=" in stopped.value.hint
    assert len(prompts) == 2
    prompts.clear()
    summary = run_task(cfg)
    assert len(prompts) == 1  # only the point that had not run generates
    assert "removal/small_dense/n3_k3/es_act" in summary and "removal/inference_reduce/n8_k1" in summary
