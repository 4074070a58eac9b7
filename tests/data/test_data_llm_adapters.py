import json

import pytest

from moe_lab.data import sources
from moe_lab.data.llm_adapters import load_llm_adapters, row_start_lines
from moe_lab.data.shipped import LLM_ADAPTERS_DIR

MATH_DATA = LLM_ADAPTERS_DIR / "math_data.json"


def test_math_data_loads_all_rows():
    rows = load_llm_adapters(str(MATH_DATA))
    raw = json.loads(MATH_DATA.read_text())
    assert len(rows) == len(raw) == 3260
    for row, ref in zip(rows, raw):
        assert row["instruction"] == ref["instruction"] and row["output"] == ref["output"]
        assert row["input"] == ref["input"] == ""
        assert row["answer"] == ref["answer"]
    assert row_start_lines(str(MATH_DATA))[:3] == [2, 8, 14]  # indent=4 array, 6 lines per row


def _rows(n):
    return [{"instruction": f"q{i}", "input": "", "output": f"a{i}", "answer": str(i)} for i in range(n)]


def test_json_array_missing_output_reports_line(tmp_path):
    rows = _rows(5)
    del rows[3]["output"]
    path = tmp_path / "broken_train.json"
    text = json.dumps(rows, indent=2)
    path.write_text(text)
    expected_line = [i + 1 for i, line in enumerate(text.split("\n")) if line == "  {"][3]
    assert expected_line == 2 + 3 * 6  # "[" line, then 6 lines per row (indent=2, 4 fields)
    with pytest.raises(ValueError) as info:
        load_llm_adapters(str(path))
    msg = str(info.value)
    assert "'output'" in msg and "broken_train.json" in msg and f"line {expected_line}" in msg


def test_json_array_compact_and_irregular_layout(tmp_path):
    path = tmp_path / "odd.json"
    path.write_text(
        '[{"instruction": "a", "output": "x"},\n'
        "\n"
        '   {"instruction": "b",\n "output": "y"},  {"instruction": "c",\n'
        '"output": "[not, a, row]\\n"},\n'
        '{"instruction": "d", "output": null}\n]\n'
    )
    assert row_start_lines(str(path)) == [1, 3, 4, 6]
    with pytest.raises(ValueError, match=r"odd\.json.*line 6.*'output'"):
        load_llm_adapters(str(path))


def test_jsonl_missing_instruction_reports_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    lines = [json.dumps(r) for r in _rows(4)]
    lines.insert(2, "")  # blank line: rows after it are one line further down
    lines[3] = json.dumps({"input": "", "output": "a2"})  # row 2, on line 4
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as info:
        load_llm_adapters(str(path))
    msg = str(info.value)
    assert "'instruction'" in msg and "broken.jsonl" in msg and "line 4" in msg


def test_optional_fields_and_jsonl(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(
        '{"instruction": "a", "output": "x"}\n{"instruction": "b", "output": "y", "input": "ctx"}\n'
    )
    rows = load_llm_adapters(str(path))
    assert [r["input"] for r in rows] == ["", "ctx"]
    assert all(r.get("answer") is None for r in rows)


def test_missing_file_and_unreachable_hub(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="dataset.path=/local/file.json"):
        load_llm_adapters(str(tmp_path / "nope.json"))

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'some-org/some-data' on the Hub")

    monkeypatch.setattr(sources, "load_dataset", offline)
    with pytest.raises(OSError) as info:
        load_llm_adapters("some-org/some-data")
    assert "some-org/some-data" in str(info.value) and "dataset.path=/local/file.json" in str(info.value)
