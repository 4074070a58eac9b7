"""A truncated teacher record (issue 32 item 8) is named with the option that gave it and the fix: before, a bare
``SafetensorError`` from inside the KD module named neither the file nor the option."""

from __future__ import annotations

import pytest
import torch

from moe_lab.distill.teacher_logits import FORMAT, RecordedTeacher, save


@pytest.mark.parametrize("keep", [0.5, 0.05])  # cut in the tensor data / inside the header
def test_a_truncated_record_names_the_file_the_option_and_the_fix(tmp_path, keep):
    path = tmp_path / "teacher_logits.safetensors"
    save({"train.0.batch_tokens": torch.tensor([4]), "train.0.logits": torch.randn(4, 64)}, path,
         {"format": FORMAT, "world_size": 1})
    RecordedTeacher(path)  # whole: it opens
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError) as err:
        RecordedTeacher(path, option="method.options.teacher_logits")
    msg = str(err.value)
    assert msg.startswith(f"method.options.teacher_logits={path}: the teacher record is truncated or corrupted")
    assert "python run.py task=teacher_logits" in msg and "point method.options.teacher_logits at the new file" in msg
