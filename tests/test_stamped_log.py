"""The settings-stamped resumable log (moe_lab.core.stamped_log): a PointLog (CSV) and a RecordLog (JSONL) reopened
with the same settings give back what was written; with a changed setting they are refused naming the file, the
key (before -> after) and the fix; a torn last JSONL line is dropped; task=evaluate's explainer words a changed
weights / data fingerprint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moe_lab.core.stamped_log import FIX, PointLog, RecordLog

SETTINGS = {"model": {"name": "tiny"}, "eval": {"max_length": 8}, "seed": 0, "values": (1, 2)}


def _changed(**eval_):
    return {**SETTINGS, "eval": {**SETTINGS["eval"], **eval_}}


def test_point_log_reopened_with_the_same_settings_gives_back_its_points(tmp_path):
    settings = {**SETTINGS, "calibration": Path("c.pt")}  # a PointLog writes what JSON cannot hold as str
    log = PointLog(tmp_path / "points.csv", ("score", "K"), settings)
    assert log.rows == [] and not log.meta.exists()  # the settings are written with the first point
    log.append({"score": "freq", "K": 2, "ppl": 1.5})
    assert log.meta == tmp_path / "points.meta.json" and log.meta.is_file()
    log.append({"score": "act", "K": 4, "ppl": 2.25})

    again = PointLog(tmp_path / "points.csv", ("score", "K"), settings)  # a Path and a tuple compare as written
    assert again.rows == [{"score": "freq", "K": 2, "ppl": 1.5}, {"score": "act", "K": 4, "ppl": 2.25}]
    assert set(again.done()) == {("freq", "2"), ("act", "4")}
    assert again.key({"score": "act", "K": 4, "ppl": 0.0}) == ("act", "4")
    assert again.settings == json.loads(again.meta.read_text())


def test_point_log_with_a_changed_setting_is_refused(tmp_path):
    PointLog(tmp_path / "points.csv", ("K",), SETTINGS).append({"K": 2, "ppl": 1.5})
    with pytest.raises(ValueError) as err:
        PointLog(tmp_path / "points.csv", ("K",), _changed(max_length=16))
    assert str(err.value) == (f"{tmp_path / 'points.csv'} holds points measured with other settings "
                              f"(eval.max_length: 8 -> 16): {FIX}")
    assert "run into a new output directory (hydra.run.dir=...) or delete that file to start over" in FIX


def test_record_log_reopened_with_the_same_settings_gives_back_its_records(tmp_path):
    log = RecordLog(tmp_path / "predictions", "addsub", SETTINGS)
    assert log.path == tmp_path / "predictions" / "addsub.jsonl"
    assert log.meta == tmp_path / "predictions" / "addsub.meta.json" and log.meta.is_file()  # written on opening
    assert log.load() == {}
    log.append([{"id": 1, "prediction": "4"}, {"id": "b", "prediction": ["é", "x"]}])
    log.append([{"id": 3, "prediction": "7"}])

    again = RecordLog(tmp_path / "predictions", "addsub", SETTINGS)
    assert again.load() == {"1": {"id": 1, "prediction": "4"}, "b": {"id": "b", "prediction": ["é", "x"]},
                            "3": {"id": 3, "prediction": "7"}}


def test_record_log_with_a_changed_setting_is_refused(tmp_path):
    RecordLog(tmp_path, "addsub", SETTINGS).append([{"id": 1}])
    with pytest.raises(ValueError) as err:
        RecordLog(tmp_path, "addsub", {**SETTINGS, "seed": 1})
    assert str(err.value) == f"{tmp_path / 'addsub.jsonl'} was written with other settings (seed: 0 -> 1): {FIX}"


def test_record_log_drops_a_torn_last_line(tmp_path):
    log = RecordLog(tmp_path, "addsub", SETTINGS)
    log.append([{"id": 1, "prediction": "4"}, {"id": 2, "prediction": "5"}])
    whole = log.path.read_bytes()
    with open(log.path, "ab") as f:
        f.write(b'{"id": 3, "predic')  # a kill mid-write

    again = RecordLog(tmp_path, "addsub", SETTINGS)
    assert list(again.load()) == ["1", "2"]
    assert log.path.read_bytes() == whole  # the torn line is removed from the file
    again.append([{"id": 3, "prediction": "6"}])
    assert list(again.load()) == ["1", "2", "3"]


def test_record_log_refuses_a_bad_line_that_is_not_the_last(tmp_path):
    log = RecordLog(tmp_path, "addsub", SETTINGS)
    log.path.write_text('{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(ValueError, match=r"addsub.jsonl: line 2 is not valid JSON; delete the file to start over"):
        log.load()


@pytest.mark.parametrize("key, what", [
    ("weights", ("with another model (its weights changed since: the fingerprint differs; see "
                 "moe_lab.eval.fingerprint)")),
    ("data", ("for other contents of the set (its rows changed since under the same name: the data fingerprint "
              "differs; the predictions would be scored against other answers)")),
])
def test_evaluate_explains_a_changed_fingerprint(tmp_path, key, what):
    from moe_lab.runs.evaluate import prediction_mismatch

    before = {**SETTINGS, "weights": "w1", "data": "d1"}
    RecordLog(tmp_path, "addsub", before, explain=prediction_mismatch).append([{"id": 1}])
    with pytest.raises(ValueError) as err:
        RecordLog(tmp_path, "addsub", {**before, key: "x2"}, explain=prediction_mismatch)
    assert str(err.value) == (f"{tmp_path / 'addsub.jsonl'} was written {what} ({key}: '{key[0]}1' -> 'x2'). "
                              "Evaluate into a new output directory (hydra.run.dir=...) or delete that file to "
                              "start it over.")
    assert re.search(rf"\({key}: '{key[0]}1' -> 'x2'\)", str(err.value))
