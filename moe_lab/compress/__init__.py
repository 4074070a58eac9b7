"""Compression: calibration statistics (one teacher pass), expert scores and selection, and the weight
surgery built on them (see docs/specs/compression.md).

Note: ``moe_lab.compress.scores`` is the scoring FUNCTION; import helpers from the module with
``from moe_lab.compress.scores import ...`` (``import moe_lab.compress.scores as m`` yields the function).
"""

from .calibration import Calibration, calibrate
from .condense import condense, export_condensed, js_divergence, load_condensed
from .dense import export_compressed, to_dense
from .prune import prune_experts
from .scores import METHODS as SCORE_METHODS
from .scores import scores, select_experts

__all__ = ["SCORE_METHODS", "Calibration", "calibrate", "condense", "export_compressed",
           "export_condensed", "js_divergence", "load_condensed", "prune_experts", "scores",
           "select_experts", "to_dense"]
