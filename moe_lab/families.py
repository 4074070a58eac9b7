"""Every MoE causal-LM model type of the installed transformers, and what moe-lab does with it.

Each model type whose decoder layers hold a sparse-MoE block is in exactly one state: ``supported`` (a
registry entry, :mod:`moe_lab.moe.registry`), ``refused`` (:data:`REFUSED`, with the reason) or ``not looked at``
(:data:`NOT_LOOKED_AT`). ``tests/test_families.py`` fails when a transformers release adds one in none of them.

``python -m moe_lab.families`` lists them; ``--markdown`` prints the support matrix (family x method, the reason in
every refused cell); ``--write-docs`` writes it into docs/families.md (the documentation site's support-matrix
page, which the README links) between the ``families`` markers.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from pathlib import Path

from .methods import METHODS
from .methods.registry import undefined_reason

ROOT = Path(__file__).resolve().parents[1]
MATRIX_PAGE = ROOT / "docs" / "families.md"
MATRIX_BEGIN, MATRIX_END = "<!-- families:begin -->", "<!-- families:end -->"

_COMPOSITE = "composite multimodal config: its text decoder is model_type {}"
# model_type -> why moe-lab has no registry entry for it (what the uniform view cannot express yet)
REFUSED: dict[str, str] = {
    "jetmoe": "mixture of attention heads plus parallel experts (input_linear / output_linear split by expert "
              "size) with an output bias",
    "deepseek_v4": "hash-routed layers choose experts from the token id (tid2eid; the block needs input_ids); "
                   "clamped-SwiGLU experts",
    "gemma4_text": "the router normalises and scales its input and scales the weights per expert; the MoE runs "
                   "beside a dense MLP inside the decoder layer",
    "inkling_text": "shared experts are gated by extra router logits (the router returns shared gammas; "
                    "log-sigmoid softmax over the selected + shared logits)",
    "longcat_flash": "zero-computation (identity) experts beyond the real ones; router weight in "
                     "router.classifier",
    "nemotron_h": "experts run in a latent space (fc1 / fc2_latent_proj around them) and are non-gated (up / "
                  "down, relu2)",
    "zaya": "the router is an MLP on a down-projected state carried across layers, with a skip expert",
    "inkling2_loop_text": "looped decoder: layers loop_layer_index_start..loop_layer_index_end-1 run their MoE block "
                          "loop_num_passes times per forward (each pass routes every token again, on the previous "
                          "pass's messages), so a layer's routing statistics count each token several times "
                          "(docs/design.md invariant 3: once per token) and its calibration mixes passes; the uniform view "
                          "has no pass index. The block itself is Inkling-2's (supported: inkling2_text)",
    "qwen3_5_moe": _COMPOSITE.format("qwen3_5_moe_text"),
    "qwen4_exp": _COMPOSITE.format("qwen4_exp_text"),
    "dots3_note": _COMPOSITE.format("dots3_note_text"),
    "llama4": _COMPOSITE.format("llama4_text") + ", supported; moe-lab loads no composite, so that an export never "
              "silently drops the vision tower: AutoModelForCausalLM.from_pretrained(<llama4 checkpoint>) builds the "
              "text decoder alone (Llama4ForCausalLM, weights mapped), and its save_pretrained folder is a "
              "llama4_text checkpoint for model.pretrained",
    "gemma4": _COMPOSITE.format("gemma4_text"),
}
# model_type -> note: MoE model types nobody has examined yet
NOT_LOOKED_AT: dict[str, str] = {}

#: the support matrix's columns: every registered method (moe_lab.methods.registry, in registration order), LoRA,
#: compression and KD
COLUMNS = ("conformance", *METHODS, "lora", "calibrate/to_dense/prune", "condense", "kd")
_EXPERTS = re.compile(r"self\.experts\s*=")


@functools.lru_cache(maxsize=1)
def moe_model_types() -> tuple[str, ...]:
    """Causal-LM model types of the installed transformers whose modeling code builds a sparse-MoE block (a
    module assigning ``self.experts``), found statically from the modeling sources (no model is imported)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = Path(transformers.__file__).parent
    modules = transformers._class_to_module
    found = []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        module = modules.get(class_name)
        path = root.joinpath(*module.split(".")).with_suffix(".py") if module else None
        if path is not None and path.is_file() and _EXPERTS.search(path.read_text(encoding="utf-8")):
            found.append(model_type)
    return tuple(sorted(found))


def family_states() -> dict[str, tuple[str, str]]:
    """model_type -> (state, note) for every MoE model type: supported | refused | not looked at | unknown."""
    from .moe.registry import FAMILIES

    states = {}
    for model_type in moe_model_types():
        if model_type in FAMILIES:
            states[model_type] = ("supported", FAMILIES[model_type].notes)
        elif model_type in REFUSED:
            states[model_type] = ("refused", REFUSED[model_type])
        elif model_type in NOT_LOOKED_AT:
            states[model_type] = ("not looked at", NOT_LOOKED_AT[model_type])
        else:
            states[model_type] = ("unknown", ("new in this transformers: add a registry entry or a REFUSED / "
                                             "NOT_LOOKED_AT line in moe_lab/families.py"))
    return states


def _tiny_rule(model_type: str):
    """The registry spec and the routing rule of the family's tiny config (conf/model/tiny_<family>.yaml)."""
    from omegaconf import OmegaConf

    from .models import build_config
    from .moe.registry import family_spec

    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"tiny_{model_type}.yaml")
    spec = family_spec(model_type)
    return spec, spec.routing_rule(build_config(cfg.config_class, cfg.config))


def _cell(method: str, spec, rule) -> str:
    reason = undefined_reason(method, spec, rule)
    return "yes" if reason is None else f"no: {reason}"


def matrix_row(model_type: str) -> dict[str, str]:
    """One family's support-matrix cells (``COLUMNS``), from the family registry and each method's registration
    (:func:`moe_lab.methods.registry.undefined_reason`)."""
    spec, rule = _tiny_rule(model_type)
    row = {column: _cell(column, spec, rule) for column in COLUMNS}
    row["conformance"] = "bit-exact (fp32, bf16)"
    target = spec.dense_target
    dense = (f"to_dense -> {target.config_class or model_type} ({target.form})" if target is not None
             else f"to_dense: {undefined_reason('to_dense', spec, rule)}")
    gated = "; ".join(f"{score}: no: {reason}" for score in ("reap", "es_mag")
                      if (reason := undefined_reason(score, spec, rule)) is not None)
    row["calibrate/to_dense/prune"] = f"calibrate, prune{f' ({gated})' if gated else ''}; {dense}"
    return row


def table_cell(text: str) -> str:
    """``text`` as a Markdown table cell that renders as itself: ``&`` and ``<`` as HTML entities (else
    ``<dL/dy, E_e(x)>`` is read as an HTML tag and vanishes from the page), ``|`` escaped (else it splits the cell)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|")


def markdown() -> str:
    """The support matrix and the refused / not-looked-at list, as markdown."""
    import transformers

    from .moe.registry import supported_families

    states = family_states()
    counts = {s: sum(1 for v, _ in states.values() if v == s) for s in ("supported", "refused", "not looked at")}
    lines = [
        (f"transformers {transformers.__version__}: {len(states)} causal-LM model types with a sparse-MoE block; "
        f"{counts['supported']} supported, {counts['refused']} refused, {counts['not looked at']} not looked at "
        "(generated by `python -m moe_lab.families --write-docs`)."),
        "",
        "| family | " + " | ".join(COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for model_type in supported_families():
        row = matrix_row(model_type)
        lines.append(f"| {model_type} | " + " | ".join(table_cell(row[c]) for c in COLUMNS) + " |")
    lines += ["", "| model_type | state | reason |", "|---|---|---|"]
    for model_type, (state, note) in states.items():
        if state != "supported":
            lines.append(f"| {model_type} | {state} | {table_cell(note)} |")
    return "\n".join(lines)


def with_matrix(text: str) -> str:
    """``text`` (docs/families.md) with the block between the families markers replaced by :func:`markdown`."""
    start, end = text.find(MATRIX_BEGIN), text.find(MATRIX_END)
    if start < 0 or end < start:
        raise ValueError(f"{MATRIX_PAGE.name} lacks the markers {MATRIX_BEGIN} ... {MATRIX_END}")
    return text[: start + len(MATRIX_BEGIN)] + "\n" + markdown() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_lab.families", description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the support matrix as markdown")
    parser.add_argument("--write-docs", action="store_true", help=f"write the matrix into {MATRIX_PAGE}")
    parser.add_argument("--write-readme", action="store_true", help="the former name of --write-docs")
    args = parser.parse_args(argv)
    if args.write_readme:
        print("--write-readme is now --write-docs: the matrix lives in docs/families.md (the README links it)")
    if args.write_docs or args.write_readme:
        tmp = MATRIX_PAGE.with_name(f".{MATRIX_PAGE.name}.tmp")
        tmp.write_text(with_matrix(MATRIX_PAGE.read_text(encoding="utf-8")), encoding="utf-8")
        os.replace(tmp, MATRIX_PAGE)
        print(f"wrote the support matrix into {MATRIX_PAGE}")
    elif args.markdown:
        print(markdown())
    else:
        for model_type, (state, note) in family_states().items():
            print(f"{model_type:24s} {state:14s} {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
