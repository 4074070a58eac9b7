"""[CD-code]'s calibration rows (issue 18 item 10): ``sample=documents``: one document per row, BOS, truncated
to seq_len, padded; ``seq_len=null``: whole documents (the code's fixed-gate pass at batch 1)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from moe_lab.compress import calibrate
from moe_lab.data.tokenizer import load_tokenizer
from moe_lab.runs.calibrate import calibration_sequences
from tests.conftest import build_tiny


def _docs(path):
    docs = ["alpha beta gamma delta " * k for k in (1, 9, 3, 14, 2)]
    path.write_text("\n".join(docs[:2] + [""] + docs[2:]))  # an empty line is skipped, not a row
    return docs


def _cfg(path, **kw):
    data = OmegaConf.create({"_target_": "moe_lab.data.text.TextBlockDataModule", "path": str(path),
                             "block_size": 16, "batch_size": 2, "streaming": False})
    c = OmegaConf.create({"num_sequences": 4, "seq_len": 16, "batch_size": 3, "sample": "documents",
                          "pool_blocks": None, "seed": 0, **kw})
    return data, c


def test_documents_rows_bos_truncated_padded(tmp_path):
    tok = load_tokenizer("byte")
    docs = _docs(tmp_path / "d.txt")
    data, c = _cfg(tmp_path / "d.txt")
    batches, label = calibration_sequences(data, tok, c)
    assert "first 4 documents" in label and "truncated to 16" in label
    rows = [(b["input_ids"][i], b["attention_mask"][i]) for b in batches for i in range(b["input_ids"].shape[0])]
    assert [b["input_ids"].shape[0] for b in batches] == [3, 1]
    for (ids, mask), doc in zip(rows, docs[:4]):
        want = ([tok.bos_token_id] + tok(doc, add_special_tokens=False)["input_ids"])[:16]
        assert ids[: len(want)].tolist() == want and mask.tolist() == [1] * len(want) + [0] * (len(mask) - len(want))


def test_documents_mode_says_it_takes_the_first_documents(tmp_path, caplog):
    """One line says the rows are the file's first n documents (not a random draw) and how to use [CD-code]'s."""
    _docs(tmp_path / "d.txt")
    data, c = _cfg(tmp_path / "d.txt")
    with caplog.at_level("INFO", logger="moe_lab.runs.calibrate"):
        calibration_sequences(data, load_tokenizer("byte"), c)
    lines = [r.getMessage() for r in caplog.records if "sample=documents" in r.getMessage()]
    assert len(lines) == 1 and "the first 4 documents of" in lines[0] and str(tmp_path / "d.txt") in lines[0]
    assert "in file order" in lines[0] and "calibration_data.json" in lines[0]


def test_untruncated_documents_gate_pass_counts_every_token(tmp_path):
    tok = load_tokenizer("byte")
    docs = _docs(tmp_path / "d.txt")
    data, c = _cfg(tmp_path / "d.txt", seq_len=None, batch_size=1)
    batches, label = calibration_sequences(data, tok, c)
    lengths = [1 + len(tok(d, add_special_tokens=False)["input_ids"]) for d in docs[:4]]
    assert "untruncated" in label and [b["input_ids"].shape for b in batches] == [(1, n) for n in lengths]
    model = build_tiny("deepseek_v2", max_position_embeddings=512).eval()
    cal = calibrate(model, batches)
    k = model.config.num_experts_per_tok
    for stats in cal.layers.values():  # every real token selects k experts: sum of counts = k x tokens
        assert int(stats["count"].sum()) == k * sum(lengths)
    assert sum(lengths) > 16 * 4  # longer than the truncated rows


def test_documents_mode_refuses_unknown_modes_and_short_data(tmp_path):
    tok = load_tokenizer("byte")
    _docs(tmp_path / "d.txt")
    data, c = _cfg(tmp_path / "d.txt", sample="blocks")
    with pytest.raises(ValueError, match="sample='blocks'"):
        calibration_sequences(data, tok, c)
    data, c = _cfg(tmp_path / "d.txt", num_sequences=6)
    with pytest.raises(ValueError, match="fewer than num_sequences=6"):
        calibration_sequences(data, tok, c)
