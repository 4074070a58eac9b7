"""Options with holes in their ranges are refused or said (issue 21 item 15): a negative condenser gamma (the sign
would flip the method into its opposite); a dataset too small for a validation row warns in one line."""

from __future__ import annotations

import logging
import math

import pytest

import moe_lab
from moe_lab.data.datamodule import SFTDataModule
from moe_lab.data.tokenizer import build_byte_tokenizer
from tests.conftest import build_tiny


@pytest.mark.parametrize("gamma", [-1, -1e-4, math.nan])
def test_negative_condenser_gamma_is_refused_naming_the_sign_option(gamma):
    with pytest.raises(ValueError, match=r"method.options.gamma=\S+: the bias step must be >= 0; the direction is "
                                         r"method.options.sign \(sparsify \| balance\)"):
        moe_lab.apply(build_tiny("olmoe"), "condenser", gamma=gamma)


def test_zero_gamma_is_accepted():
    moe_lab.apply(build_tiny("olmoe"), "condenser", gamma=0.0)


def _setup(rows: int, caplog, **kw):
    dm = SFTDataModule(source="synthetic", num_examples=rows, max_length=512, batch_size=1,
                       tokenizer=build_byte_tokenizer(), **kw)
    with caplog.at_level(logging.WARNING, logger="moe_lab.data.datamodule"):
        dm.setup("fit")
    return dm, [r.getMessage() for r in caplog.records if "validation" in r.getMessage()]


def test_one_row_dataset_warns_that_validation_is_empty(caplog):
    dm, said = _setup(1, caplog)
    assert len(dm.rows["train"]) == 1 and dm.rows["val"] == []
    assert len(said) == 1 and "val_fraction=0.05 leaves no validation row" in said[0]
    assert "dataset.val_fraction=0" in said[0]


def test_no_warning_when_validation_has_rows_or_is_off(caplog):
    assert _setup(2, caplog)[1] == []
    caplog.clear()
    assert _setup(1, caplog, val_fraction=0.0)[1] == []
