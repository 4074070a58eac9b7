import csv

import numpy as np
import pytest
from matplotlib.image import imread

from moe_lab.analysis.plots import expert_load_heatmap, loss_curve, read_metric_csv


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_heatmap_writes_a_png(tmp_path):
    fractions = np.full((3, 8), 1 / 8)
    fractions[1] = 0.0
    fractions[1, 2] = 1.0
    out = expert_load_heatmap(fractions, [0, 2, 5], tmp_path / "sub" / "h.png", title="load")
    assert out == tmp_path / "sub" / "h.png" and _is_png(out)
    image = imread(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05  # something was drawn
    assert not list(out.parent.glob(".*tmp"))  # the temporary file was renamed
    with pytest.raises(ValueError):
        expert_load_heatmap(fractions, [0, 1], tmp_path / "bad.png")


def test_loss_curve_from_pairs_and_lightning_csv(tmp_path):
    out = loss_curve([(0, 3.0), (1, 2.5), (2, 2.0)], tmp_path / "a.png")
    assert _is_png(out)

    path = tmp_path / "metrics.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "grad_norm/total", "step", "train/loss_step", "val/loss"])
        w.writerow([0, "", 0, 3.0, ""])
        w.writerow(["", 1.0, 1, "", ""])
        w.writerow([0, "", 1, 2.5, ""])
        w.writerow([0, "", 1, "", 2.7])
    assert read_metric_csv(path, "train/loss") == [(0, 3.0), (1, 2.5)]
    assert read_metric_csv(path, "val/loss") == [(1, 2.7)]
    assert read_metric_csv(path, "nope") == []
    assert _is_png(loss_curve(path, tmp_path / "b.png"))
    with pytest.raises(ValueError):
        loss_curve(path, tmp_path / "c.png", keys=("nope",))
