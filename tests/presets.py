"""Every real-model preset of conf/experiment, with local data and its family's tiny sibling, for the tests that
run (tests/test_presets_run.py) and plan (tests/runtime/test_plan.py) them offline.

Local data: a few rows of the packaged math_data.json (moe_lab/data/files/llm_adapters), rewritten into each dataset format the
presets read (LLM-Adapters rows, chat messages, reasoning traces, ShareGPT turns, prompt/completion fields, plain
text), so every dataset node of a preset (``dataset``, calibration, search and LM-stage data) reads a local file.
"""

from __future__ import annotations

import functools
import itertools
import json
import string
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import DATA_DIR, ROOT

CONF = ROOT / "conf"
EXPERIMENTS = CONF / "experiment"
#: dataset nodes a preset may read besides ``dataset``
DATA_NODES = ("dataset", "compress.calibration.dataset", "condense.search.dataset", "cd_sft.lm_stage.dataset")


def real_model_presets() -> list[str]:
    """conf/experiment/**.yaml (not the row/ add-ons) whose model is a real checkpoint (not a tiny_* model)."""
    names = sorted(p.relative_to(EXPERIMENTS).with_suffix("").as_posix() for p in EXPERIMENTS.rglob("*.yaml")
                   if p.parent.name != "row")
    return [n for n in names if not compose_preset(n).model.name.startswith("tiny_")]


@functools.cache
def compose_preset(preset: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=[f"experiment={preset}", *overrides])


def preset_rows(preset: str) -> list[tuple[str, ...]]:
    """The overrides of each job ``python run.py -m experiment=<preset>`` runs: the cartesian product of the
    preset's ``hydra.sweeper.params``, as Hydra's basic sweeper expands them (one empty row without them)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={preset}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.get("params") or {}
    dims = []
    for o in OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()]):
        key = o.get_key_element()
        values = o.sweep_string_iterator() if o.is_sweep_override() else [o.get_value_element_as_str()]
        dims.append([f"{key}={v}" for v in values])
    return list(itertools.product(*dims))


def tiny_sibling(preset: str) -> str:
    """``tiny_<family>`` of the preset's model (conf/model/<model>.yaml ``family``)."""
    name = f"tiny_{compose_preset(preset).model.family}"
    assert (CONF / "model" / f"{name}.yaml").is_file(), f"{preset}: no conf/model/{name}.yaml"
    return name


def _rows(n: int) -> list[dict]:
    """The ``n`` shortest rows of math_data.json (short rows keep tiny runs fast)."""
    rows = json.loads((DATA_DIR / "math_data.json").read_text())
    return sorted(rows, key=lambda r: len(r["instruction"]) + len(r["output"]))[:n]


def _fields(template: str | None) -> set[str]:
    return {f for _, f, _, _ in string.Formatter().parse(template or "") if f}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data_file(node, tmp: Path, n: int) -> Path:
    """A local file of ``n`` rows in the format the dataset node ``node`` reads."""
    rows, target = _rows(n), str(node._target_)
    source = node.get("source")
    if target.endswith("TextBlockDataModule"):
        path = tmp / "text.txt"
        path.write_text("\n".join(f"{r['instruction']} {r['output'].strip()}" for r in rows) + "\n")
        return path
    if target.endswith("PromptCompletionDataModule"):
        prompt = _fields(node.prompt) | _fields(node.get("prompt_with_input"))
        completion = _fields(node.completion)
        made = [{**{f: r["instruction"] for f in prompt - {node.get("input_field")}},
                 **{f: r["output"].strip() for f in completion}} for r in rows]
        return _write_jsonl(tmp / "prompt_completion.jsonl", made)
    if target.endswith("ShareGPTDataModule"):
        made = [{node.conversations_field: [{"from": "human", "value": r["instruction"]},
                                            {"from": "gpt", "value": r["output"].strip()}]} for r in rows]
        return _write_jsonl(tmp / "sharegpt.jsonl", made)
    if source == "chat":
        made = [{node.messages_field: [{"role": "user", "content": r["instruction"]},
                                       {"role": "assistant", "content": r["output"].strip()}]} for r in rows]
        return _write_jsonl(tmp / "chat.jsonl", made)
    if source == "reasoning":
        fmt = {"question_field": "question", "trace_field": "thinking_trajectories", "answer_field": "attempt",
               **(OmegaConf.to_container(node.reasoning) if node.get("reasoning") else {})}
        made = [{fmt["question_field"]: r["instruction"], fmt["trace_field"]: [r["output"].strip()],
                 fmt["answer_field"]: r["answer"]} for r in rows]
        return _write_jsonl(tmp / "reasoning.jsonl", made)
    if source == "llm_adapters":
        return _write_jsonl(tmp / "llm_adapters.jsonl", rows)
    raise AssertionError(f"no local data writer for dataset {target} (source={source})")


def data_overrides(cfg, tmp: Path, n: int = 8, max_length: int = 256, block_size: int = 32,
                   resize: bool = True) -> list[str]:
    """Overrides pointing every dataset node of ``cfg`` at a local file of ``n`` rows; ``resize``: also cut the
    data to ``n`` rows of ``max_length`` tokens (text: ``n`` blocks of ``block_size``, read whole)."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = []
    for prefix in DATA_NODES:
        node = OmegaConf.select(cfg, prefix)
        if node is None or "_target_" not in node or node.get("source") == "synthetic":
            continue
        folder = tmp / prefix.replace(".", "_")
        folder.mkdir(exist_ok=True)
        path = data_file(node, folder, n)
        out.append(f"{prefix}.path={path}")
        if "name" in node:
            out.append(f"{prefix}.name=null")
        if not resize:
            continue
        if str(node._target_).endswith("TextBlockDataModule"):
            out += [f"{prefix}.streaming=false", f"{prefix}.block_size={block_size}", f"{prefix}.num_blocks={n}",
                    f"{prefix}.val_split=null", f"{prefix}.batch_size=2"]
        else:
            out += [f"{prefix}.num_examples={n}", f"{prefix}.max_length={max_length}"]
    return out
