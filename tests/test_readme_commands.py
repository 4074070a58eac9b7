"""Every command README.md, the documentation pages (docs/*.md, in the site's nav order) and experiments/*/README.md
show either runs here or is listed with the reason it cannot.

Commands are taken from ```bash / ```sh / ```shell / ```console blocks, indented code blocks and inline code
spans that start with ``python`` (optionally after ``VAR=value`` assignments); a backslash continues a line and a
trailing ``# comment`` is dropped. Each is either in NOT_RUNNABLE (command -> reason: a GPU, the hub, a cluster,
an elided synopsis, a benchmark) or run on the CPU, in document order, by one Python process (``python -m
tests.test_readme_commands <plan>``) that runs ``run.py`` / ``python -m <module>`` in-process (imports paid once)
in a scratch directory, after the substitutions of SUBSTITUTIONS. Each run must exit 0.
"""

from __future__ import annotations

import glob
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _site_pages() -> list[Path]:
    """docs/*.md in the order of mkdocs.yml's nav (generated pages such as the API reference have no commands)."""
    import yaml

    def walk(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = [ROOT / "docs" / page for page in walk(nav) if page.endswith(".md")]
    return pages + sorted(set((ROOT / "docs").glob("*.md")) - set(pages))  # a page missing from the nav still counts


DOCS = [ROOT / "README.md", *_site_pages(), *sorted((ROOT / "experiments").glob("*/README.md"))]
SHELL_BLOCKS = ("bash", "sh", "shell", "console")
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+\s+)*python\s")

TINY = {"olmoe": "tiny_olmoe", "olmoe_0125": "tiny_olmoe", "qwen1_5_moe": "tiny_qwen2_moe",
        "qwen3_moe": "tiny_qwen3_moe", "qwen3_30b_a3b_base": "tiny_qwen3_moe", "deepseek_v2_lite": "tiny_deepseek_v2",
        "deepseek_coder_v2_lite_instruct": "tiny_deepseek_v2", "gpt_oss_20b": "tiny_gpt_oss",
        "mixtral": "tiny_mixtral", "phimoe": "tiny_phimoe",
        "deepseek_moe_16b": "tiny_qwen2_moe"}  # DeepSeekMoE-16B converted to Qwen2-MoE (moe_lab.convert)
#: every hardware choice that needs GPUs (the presets name 8-GPU settings) -> hardware=cpu
GPU_HARDWARE = sorted(p.stem for p in (ROOT / "conf" / "hardware").glob("*.yaml") if p.stem not in ("cpu", "ddp_cpu"))

SUBSTITUTIONS = {
    # 1. Text of the command (regex -> replacement): real checkpoints, /local files and placeholders. {data} is
    #    the scratch data folder (tiny files in each format, written by write_data); {latest:<glob>} is the newest
    #    path matching <glob> when the command runs (the run an earlier README command made).
    "text": [
        (r"\s*model\.pretrained=\S+", ""),  # real weights: the tiny sibling (below) is random
        (r"=/local/(math_7k|commonsense_170k)\.json|=<commonsense_170k\.json>", "={data}/alpaca.json"),
        (r"=/local/(fineweb_edu\.jsonl|wikitext-103|wiki\.\S+)|=<c4\.jsonl>", "={data}/text.txt"),
        (r"/tmp/(train|test)\.txt", r"\1.txt"),  # the CPU smoke run's text files: written in the scratch dir
        (r"(collect condense |task\.resume=)<run>", r"\1{latest:outputs/cd_moe_sft/*/*}"),
        (r"<condense run>", "{latest:outputs/condense/*/*}"),
        (r"<evaluate sweep dir>", "{latest:multirun/evaluate/*}"),
        (r"<student>|<conf/model entry or path>", "tiny_qwen3_moe"),
        (r"outputs/finetune/tiny_olmoe_sft/2026-11-22_10-00-00|<run>(?=/)",
         "{latest:outputs/finetune/tiny_olmoe_sft/*}"),
        (r"<calib>/calibration\.safetensors", "<calib>"),
        (r"<calib run>", "{latest:outputs/calibrate/tiny_qwen3_moe_*/*}"),
        (r"(deepseek_moe_\w+|qwen1_5_moe_\w+) (.*)=(<calib>|\.\.\.)",  # DeepSeekMoE-16B (converted) and Qwen1.5-MoE:
         #   both have the tiny Qwen2-MoE sibling, whose calibration the DeepSeekMoE calibrate command makes
         r"\1 \2={latest:outputs/calibrate/tiny_qwen2_moe_*/*}/calibration.safetensors"),
        (r"(model=deepseek_v2_lite) (.*)=(<calib>|\.\.\.)",
         r"\1 \2={latest:outputs/calibrate/tiny_deepseek_v2_*/*}/calibration.safetensors"),
        (r"multirun/(finetune|evaluate)/<time>", r"{latest:multirun/\1/*}"),
        (r"\$\{?t\}?", "intent"),  # the ESFT-task loop variable: its first value
        (r"task\.trainer\.max_steps=\d+", "task.trainer.max_steps=3"),  # resume-to-extend: 3 > 2 steps
        (r"(\+experiment/row=compressed_experts_k_main_sweep)", r"\1 ++model.config.num_experts_per_tok=8"),  # k_main
        #   1, 2, 4 of OLMoE's top-8 need a top-8 router: the tiny OLMoE routes to all of its 8 experts
        (r"compress\.K=\d+(,\d+)*", "compress.K=4"),  # the real models' expert counts: the tiny ones have 8, top-2
    ],
    # 2. Hydra sweeps keep their first value, on the command line and in a preset's hydra.sweeper.params
    #    (tests/test_experiments.py composes every value of every documented sweep).
    "sweep": "first value",
    # 3. Group choices of the composed command -> overrides appended to it (task=estimate keeps its real model:
    #    it builds it on the meta device, without weights).
    "choice": {
        "model": {real: [f"model={tiny}"] for real, tiny in TINY.items()},
        "hardware": {name: ["hardware=cpu"] for name in GPU_HARDWARE},
        "logger": {"wandb": ["logger=csv"]},
        "dataset": {
            **{name: ["dataset.path={data}/alpaca.json"] for name in (
                "math7k", "math10k", "math14k", "commonsense15k", "commonsense170k", "mathinstruct")},
            **{name: ["dataset.path={data}/chat.jsonl"] for name in (
                "esft_intent", "esft_law", "esft_summary", "esft_translation", "tulu3")},
            **{name: ["dataset.path={data}/text.txt", "dataset.streaming=false"] for name in (
                "fineweb_edu", "c4", "wikitext2", "wikitext103")},
            "gsm8k_train": ["dataset.path={data}/gsm8k.jsonl"],
            "codealpaca": ["dataset.path={data}/codealpaca.jsonl"],
            "s1k": ["dataset.path={data}/s1k.jsonl"],
            "nemotron_code": ["dataset.path={data}/sharegpt.jsonl"],
        },
        "eval": {
            "esft": [f"eval.paths.esft_{t}={{data}}/esft_eval.jsonl" for t in ("intent", "law", "summary", "translation")],
            "hard_reasoning": ["eval.paths.aime24={data}/boxed.jsonl", "eval.paths.math500={data}/boxed.jsonl"],
        },
    },
    # 4. Shortened, local data: each key present in the composed config is set to this value (max_steps only
    #    when the command does not set it).
    "shrink": {
        "condense.num_layers": 1, "condense.search.num_sequences": 4, "condense.search.seq_len": 32,
        "condense.eval.tasks": "[llm_adapters_boolq]", "condense.eval.hub_tasks": False, "condense.eval.limit": 2,
        "condense.search.dataset.path": "{data}/text.txt", "condense.search.dataset.streaming": False,
        "compress.calibration.dataset.path": "{data}/text.txt", "compress.calibration.dataset.streaming": False,
        "compress.eval.path": "{data}/text.txt",
        "task.trainer.max_steps": 2, "task.trainer.val_check_interval": 2, "task.trainer.limit_val_batches": 1,
        "task.trainer.accumulate_grad_batches": 1, "task.checkpoint_every_n_steps": 2,
        "dataset.batch_size": 2, "dataset.max_length": 384, "dataset.num_examples": 32, "dataset.block_size": 32,
        "dataset.num_blocks": 16, "dataset.val_blocks": 2, "dataset.packing": False,
        "eval.limit": 2, "eval.generation.max_new_tokens": 8, "eval.generation.num_samples": 1,
        "compress.calibration.num_sequences": 4, "compress.calibration.seq_len": 32,
        "compress.eval.max_length": 32, "compress.eval.stride": 32, "compress.eval.max_tokens": 256,
    },
}

NOT_RUNNABLE = {
    'pip install torch==2.13.0 && pip install -e ".[dev]"': "installs packages (network, changes the environment)",
    "python -m pytest -q -n 2": "the whole test suite, which holds this test",
    'python -m pytest -q -n 2 -m "not slow"': "the quick test suite, which holds this module",
    "python -m pytest -q tests/<file>.py": "a synopsis (one test file)",
    "python -m pytest -m slurm": "needs a SLURM cluster (scripts/slurm_local.sh start; tests/runtime/test_slurm.py)",
    "python run.py -m hydra/launcher=slurm method=sft,condenser model=olmoe hardware=gpu":
        "needs a SLURM cluster (tests/runtime/test_slurm.py submits to a local one)",
    "python run.py hardware=gpu_ddp model=olmoe model.pretrained=/local/OLMoE-1B-7B-0924":
        "needs GPUs (DDP over NCCL; tests/runtime/test_strategies.py builds the strategy on CPU)",
    "python run.py hardware=deepspeed_zero3 hardware.trainer.devices=8 model=qwen3_moe ...":
        "needs 8 GPUs (DeepSpeed ZeRO-3), and `...` elides the rest",
    "python -m moe_lab.runtime.checkpoint_io convert <run>/checkpoints/last.ckpt <run>/export_from_ckpt":
        "<run> is a DeepSpeed run (last.ckpt a ZeRO directory, written on GPUs); a single-file .ckpt is refused "
        "as needing no conversion (tests/runtime/test_strategies.py converts ZeRO checkpoints of DeepSpeed's CPU engine)",
    "python -m moe_lab.runtime.checkpoint_io convert <zero dir> <out>":
        "a synopsis; a ZeRO checkpoint directory is written on GPUs (tests/runtime/test_strategies.py converts CPU ones)",
    "python run.py model=olmoe model.pretrained=/local/OLMoE-1B-7B-0924 hardware=gpu method.master_weights=optimizer":
        "needs a GPU and the OLMoE checkpoint (tests/runtime/test_optimizer_masters.py runs the flag through run.py "
        "on the tiny sibling, with a bitwise resume)",
    "python run.py hardware=gpu_ep model=qwen3_moe model.pretrained=/local/Qwen3-30B-A3B method=condenser":
        "needs 8 GPUs and the Qwen3-30B-A3B checkpoint (tests/runtime/test_expert_parallel_run.py runs hardware=ddp_cpu_ep)",
    "python run.py hardware=ddp_cpu_ep model=tiny_qwen3_moe":
        "2 DDP processes, which Lightning starts by re-running the command line: tests/runtime/test_expert_parallel_run.py "
        "runs it as a subprocess (debug=fast) and compares it with the DDP run",
    "python run.py -m hydra/launcher=slurm hardware=gpu_ep hardware.trainer.num_nodes=2 method=sft,condenser":
        "needs a SLURM cluster of 2 GPU nodes (tests/runtime/test_slurm.py runs a 2-task EP job on the local one and "
        "checks the 2-node layout)",
    "python bench/mfu.py": "needs a CUDA GPU (bf16 throughput; README Results has an H200 run)",
    "python bench/mfu.py --layers 4 --batch 8 --seq 2048 --steps 8 --warmup 2":
        "needs a CUDA GPU (bf16 throughput; README Results has an H200 run)",
    "python -m moe_lab.convert deepseek_moe /local/deepseek-moe-16b-base checkpoints/deepseek-moe-16b-base-qwen2moe":
        "needs the DeepSeekMoE-16B checkpoint (tests/test_convert.py converts a tiny one in its key layout)",
    "python run.py experiment=moe_to_dense/d2d_qwen3_32b model.pretrained=/local/Qwen3-32B "
    "compress.calibration.dataset.path=/local/wiki.train.txt compress.eval.path=/local/wiki.test.raw.txt":
        "a dense Qwen3-32B: conf/model has no tiny dense sibling (tests/compress/test_d2d.py runs d2d on a tiny "
        "dense Qwen3)",
    "python run.py experiment=moe_to_dense/d2d_distill_qwen3_32b model.pretrained=/runs/d2d/export "
    "method.teacher.pretrained=/local/Qwen3-32B dataset.path=/local/fineweb_edu.jsonl":
        "a dense Qwen3-32B teacher and the d2d export above (no tiny dense sibling in conf/model)",
    "python bench/offload.py --gpus 8 -- model.pretrained=<DeepSeek-V2-Lite> dataset.path=<math_7k.json>":
        "needs 8 GPUs under DeepSpeed offload (tests/analysis/test_offload_bench.py runs its flow on CPU)",
    "python run.py -m experiment=moe_to_dense/qwen3_30b_a3b_kprime":
        "k' = 16..96 of Qwen3-30B-A3B's 128 experts: the tiny sibling has 8 (tests/distill/test_teacher.py "
        "checks both widened-teacher readings)",
    "python run.py -m experiment=moe_to_dense/qwen3_30b_a3b method.options.teacher_top_k=128":
        "k' = 128 of Qwen3-30B-A3B's 128 experts: the tiny sibling has 8",
    "MOE_LAB_ALL_PRESETS=1 python -m pytest -m all_presets tests/test_presets_run.py":
        "an opt-in test set (tests/test_presets_run.py), not a run",
    "python run.py -m ...": "a synopsis (`...`), not a command",
    "python -m experiments.collect <paper> <evaluate run or sweep dirs>": "a synopsis, not a command",
    "python run.py -m task=compress ... compress.score=sf,acp,do_acp compress.K=8,16":
        "`...` elides the one-point command above it",
    "python run.py task=compress compress=prune compress.prune.strategy=small_dense compress.prune.n_keep=24 ...":
        "`...` elides the calibration file and model",
    "python run.py task=compress compress=paper_grid compress.calibration_file=... [compress.grid.K=[8,16,32,64,128]]":
        "`...` and `[...]` are a synopsis",
    "python run.py task=compress compress=prune compress.sweep=true compress.prune.strategy=small_moe "
    "'compress.prune.values=[48,32,24,16]' compress.calibration_file=...": "`...` elides the calibration file",
    "python run.py -m task=evaluate experiment=<the same preset> task.checkpoint=...": "a synopsis, not a command",
    "python run.py -m task=evaluate experiment=densemixer/gsm_olmoe task.checkpoint=$(ls -d multirun/dm_gsm/*/export "
    "| paste -sd, -)": "needs the hub: the preset's lm-eval gsm8k task reads openai/gsm8k",
    "HF_ALLOW_CODE_EVAL=1 python run.py -m task=evaluate experiment=densemixer/codealpaca_olmoe "
    "task.checkpoint=$(ls -d multirun/dm_code/*/export | paste -sd, -)":
        "needs the hub: lm-eval humaneval / mbpp data and HF's code_eval metric",
    "HF_ALLOW_CODE_EVAL=1 python run.py -m task=evaluate experiment=densemixer/nemotron_code_qwen3_base "
    "task.checkpoint=...": "`...` elides the exports; its lm-eval code tasks need the hub",
    "python run.py -m task=evaluate experiment=densemixer/s1_qwen3_base eval.generation.temperature=0.6 "
    "eval.generation.top_p=0.95 task.checkpoint=...": "`...` elides the exports (the s1 fine-tune above runs)",
}
for _bench in ("kd", "compress", "condense", "sft_step", "methods", "generation", "flops", "lora_experts",
               "master_weights", "expert_parallel"):
    NOT_RUNNABLE[f"python bench/{_bench}.py"] = "a benchmark: timing runs of minutes on purpose (bench/, not tests)"
for _weights in ("<OLMoE-1B-7B-0924>", "..."):
    _latency = f"python bench/compressed_experts_latency.py --model olmoe --out <dir> -- model.pretrained={_weights}"
    NOT_RUNNABLE[_latency] = ("the real OLMoE on a GPU (tests/analysis/test_compressed_experts_latency_bench.py runs "
                              "its flow on CPU at tiny width)")
NOT_RUNNABLE.update({
    "python -m experiments.collect compressed_experts <dir>": "reads the latency bench's --out folder (a GPU run)",
    "python run.py -m experiment=<preset>": "a synopsis (each preset's own command runs)",
    "python run.py task.resume=<run dir>": "a synopsis (tests/runtime/test_resume_guard.py and the resume tests of "
                                           "every task run it)",
    "python run.py task=<name> model=<model>": "a synopsis (tests/test_how_to_add.py runs it on a toy task)",
    "python run.py method=<name>": "a synopsis (tests/test_how_to_add.py runs it on a toy method)",
    "python run.py experiment=<preset> +experiment/row=<row>": "a synopsis (each preset's own command runs)",
    "python bench/compress.py --sweep-only": "a benchmark (minutes of timing on purpose)",
    "python bench/methods.py --steps 8": "a benchmark (minutes of timing on purpose)",
    "python bench/methods.py --steps 8 --methods sft,esft --threads 1": "a benchmark (minutes of timing on purpose)",
})


# ------------------------------------------------------------------------------------------------------------
# Extraction


def _logical_lines(lines: list[str]) -> list[str]:
    """Shell lines joined at backslashes, prompts and trailing comments dropped, loop keywords skipped."""
    out = []
    for line in re.sub(r"\s*\\\n\s*", " ", "\n".join(lines)).splitlines():
        line = re.sub(r"\s+#.*$", "", line.strip().removeprefix("$ "))
        if line and not line.startswith("#") and not re.match(r"^(for|do|done)\b", line):
            out.append(line)
    return out


def commands_in(text: str) -> list[str]:
    """The commands of one Markdown document, in order (see the module docstring)."""
    lines, found, i, previous_blank = text.splitlines(), [], 0, True
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            if fence.group(1) in SHELL_BLOCKS:
                found += _logical_lines(lines[i + 1:end])
            i, previous_blank = end + 1, False
            continue
        if previous_blank and line.startswith("    ") and COMMAND.match(line.strip()):
            end = i
            while end < len(lines) and lines[end].startswith("    "):
                end += 1
            found += _logical_lines(lines[i:end])
            i = end
            continue
        found += [span.replace(r"\|", "|").strip() for span in re.findall(r"`([^`]+)`", line)
                  if COMMAND.match(span)]
        previous_blank, i = not line.strip(), i + 1
    return found


def readme_commands() -> list[str]:
    """Every command of the READMEs and the documentation pages, first appearance first, without repeats."""
    return list(dict.fromkeys(c for doc in DOCS for c in commands_in(doc.read_text())))


# ------------------------------------------------------------------------------------------------------------
# Substitution (done by the runner process, when the earlier commands' outputs exist)


def _first_of_sweeps(tokens: list[str]) -> list[str]:
    def first(tok):
        if tok.startswith("-") or "=" not in tok:
            return tok
        key, value = tok.split("=", 1)
        return tok if re.search(r"[\[\]{}()$]", value) or "," not in value else f"{key}={value.split(',')[0]}"
    return [first(t) for t in tokens]


def _late(text: str, data: Path) -> str:
    """{data}, {latest:<glob>}, ``$(ls -d <glob> | paste -sd, -)`` resolved in the current directory."""
    def latest(m):
        paths = sorted(glob.glob(m.group(1)), key=os.path.getmtime)
        if not paths:
            raise LookupError(f"no {m.group(1)} yet: a README command should make it")
        return paths[-1]

    text = text.replace("{data}", str(data))
    text = re.sub(r"\{latest:([^}]+)\}", latest, text)
    return re.sub(r"\$\(ls -d (\S+) \| paste -sd, -\)", lambda m: ",".join(sorted(glob.glob(m.group(1)))), text)


def _compose_choices(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def substitute(command: str, data: Path) -> tuple[dict, list[str]]:
    """``(environment, argv)`` that runs ``command`` here: SUBSTITUTIONS applied in order."""
    from omegaconf import OmegaConf

    for pattern, replacement in SUBSTITUTIONS["text"]:
        command = re.sub(pattern, replacement, command)
    tokens = shlex.split(_late(command, data))
    env = {}
    while re.match(r"^[A-Z_]+=", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    assert tokens[0] == "python", command
    argv = tokens[1:]
    if argv[0] != "run.py":
        return env, [a for arg in argv for a in (sorted(glob.glob(arg)) if "*" in arg else [arg])]
    args = _first_of_sweeps(argv[1:])
    import run

    overrides = [a for a in run.expand_argv(["run.py", *args])[1:] if not a.startswith("-")]
    cfg = _compose_choices(overrides)
    choices = cfg.hydra.runtime.choices
    extra = []
    for group, table in SUBSTITUTIONS["choice"].items():
        if group == "model" and choices.task == "estimate":
            continue  # task=estimate reads a real model's typed-in architecture, no weights
        extra += [o.replace("{data}", str(data)) for o in table.get(choices.get(group), [])]
    params = cfg.hydra.sweeper.get("params") if "-m" in args else None
    params = OmegaConf.to_container(params) if params else {}
    if any("," in str(v) for v in params.values()):  # a preset's own sweep (+experiment/row=...): first values
        first = ", ".join(f"{k}: {str(v).split(',')[0].strip()}" for k, v in params.items())
        extra.append(f"++hydra.sweeper.params={{{first}}}")
    given = {run._key(a) for a in args}
    for key, value in SUBSTITUTIONS["shrink"].items():
        if OmegaConf.select(cfg, key, default="<absent>") != "<absent>" and not (
                key == "task.trainer.max_steps" and key in given):
            value = str(value).lower() if isinstance(value, bool) else str(value).replace("{data}", str(data))
            extra.append(f"{key}={value}")
    return env, ["run.py", *args, *extra]


# ------------------------------------------------------------------------------------------------------------
# The runner process


def write_data(data: Path, cwd: Path) -> None:
    """Tiny local files standing in for hub data, one per format (math rows from the packaged math_data.json)."""
    from tests.conftest import DATA_DIR, word_text

    data.mkdir(parents=True, exist_ok=True)
    rows = json.loads((DATA_DIR / "math_data.json").read_text())[:48]
    (data / "alpaca.json").write_text(json.dumps(rows))
    qa = [(r["instruction"], r["output"]) for r in rows]

    def jsonl(name, make):
        (data / name).write_text("".join(json.dumps(make(q, a)) + "\n" for q, a in qa))
    jsonl("chat.jsonl", lambda q, a: {"messages": [{"role": "user", "content": q},
                                                   {"role": "assistant", "content": a}]})
    jsonl("gsm8k.jsonl", lambda q, a: {"question": q, "answer": a})
    jsonl("codealpaca.jsonl", lambda q, a: {"instruction": q, "input": "", "output": a})
    jsonl("s1k.jsonl", lambda q, a: {"question": q, "thinking_trajectories": [a], "attempt": a,  # s1K, s1K-1.1
                                     "deepseek_thinking_trajectory": a, "deepseek_attempt": a})
    jsonl("sharegpt.jsonl", lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    jsonl("esft_eval.jsonl", lambda q, a: {"prompt": q, "answers": [a]})
    jsonl("boxed.jsonl", lambda q, a: {"problem": q, "answer": "4"})
    word_text(data / "text.txt", 120)
    word_text(cwd / "train.txt", 120)
    word_text(cwd / "test.txt", 20, seed=1)
    gold = json.loads((DATA_DIR / "gsm8k.test.json").read_text())
    (cwd / "preds.jsonl").write_text("".join(json.dumps({"id": i, "prediction": f"The answer is {r['answer']}"})
                                             + "\n" for i, r in enumerate(gold)))


def _run_one(env: dict, argv: list[str]) -> int:
    """Run in this process; a multi-process run (DDP leaves its process group behind) in its own process."""
    if argv[0] == "run.py" and "hardware=ddp_cpu" in argv:
        return subprocess.run([sys.executable, str(ROOT / "run.py"), *argv[1:]], env={**os.environ, **env},
                              check=False).returncode
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        if argv[0] == "run.py":
            sys.argv = [str(ROOT / "run.py"), *argv[1:]]
            runpy.run_path(str(ROOT / "run.py"), run_name="__main__")
        elif argv[0].endswith(".py"):  # a script of the repository (scripts/, bench/)
            sys.argv = [str(ROOT / argv[0]), *argv[1:]]
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            raise ValueError(f"no runner for {argv}")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return 0


def run_plan(plan: Path) -> None:
    """``python -m tests.test_readme_commands <plan.json>``: run the commands, write ``<plan>.results.json``. A
    command whose placeholder names the output of a later README command runs after the others."""
    spec = json.loads(plan.read_text())
    cwd, data = Path(spec["cwd"]), Path(spec["cwd"]) / "data"
    os.chdir(cwd)
    sys.path.insert(0, str(ROOT))
    write_data(data, cwd)
    results, queue, deferred = [], list(spec["commands"]), set()
    started = 0.0
    while queue:
        if int(time.time()) == int(started):  # run dirs are named to the second: two runs in one second
            time.sleep(1.01 - time.time() % 1)  # would share a dir, and the second refuses to overwrite the first
        command, t0 = queue.pop(0), time.time()
        try:
            env, argv = substitute(command, data)
            print(f"\n==== README command: {command}\n==== runs as: {' '.join(argv)}", flush=True)
            rc = _run_one(env, argv)
        except LookupError as err:
            if command not in deferred:
                print(f"==== later: {command} ({err})", flush=True)
                deferred.add(command)
                queue.append(command)
                continue
            print(f"==== error: {err}", flush=True)
            rc, argv = 1, []
        except Exception as err:  # noqa: BLE001 - reported per command
            print(f"==== error: {err.__class__.__name__}: {err}", flush=True)
            rc, argv = 1, []
        # the run dir's second is taken after t0 (when Hydra starts): the next command starts after this one's end
        started = time.time()
        results.append({"command": command, "argv": argv, "rc": rc, "seconds": round(time.time() - t0, 1)})
        print(f"==== rc={rc} in {results[-1]['seconds']} s", flush=True)
        Path(str(plan) + ".results.json").write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------------------------------------
# Tests


def test_every_command_is_run_or_listed_with_a_reason():
    commands = readme_commands()
    assert len(commands) > 40
    stale = sorted(set(NOT_RUNNABLE) - set(commands))
    assert not stale, f"NOT_RUNNABLE lists commands no README shows: {stale}"
    assert all(reason.strip() for reason in NOT_RUNNABLE.values())


def test_extraction_joins_continuations_and_drops_comments():
    text = ("```bash\npython run.py a=1 \\\n    b=2   # why\n$ python -m x y\n```\n```python\npython run.py no\n```\n"
            "\n    python run.py c=3 \\\n        d=4\n\nsee `python bench/kd.py` and `HF_X=1 python run.py e=5 \\| f`\n")
    assert commands_in(text) == ["python run.py a=1 b=2", "python -m x y", "python run.py c=3 d=4",
                                 "python bench/kd.py", "HF_X=1 python run.py e=5 | f"]


def runner_verdict(returncode: int, results: list[dict] | None, commands: list[str], log: str) -> str | None:
    """What went wrong with a runner process (None: every command ran and exited 0). A runner that crashed, wrote
    no results file or results for fewer commands than planned says so, with its log's tail: it never reads as
    "0 failed"."""
    tail = f"\nrunner log (last 8000 characters):\n{log[-8000:]}"
    if results is None:
        return f"the runner wrote no results file (exit code {returncode}): it ran none of the {len(commands)} commands{tail}"
    failed = [r["command"] for r in results if r["rc"] != 0]
    if returncode != 0 or len(results) != len(commands):
        crashed = f"crashed (exit code {returncode})" if returncode != 0 else "exited 0"
        return (f"the runner {crashed} after {len(results)} of {len(commands)} commands "
                f"({len(failed)} of them failed: {failed}){tail}")
    return f"{len(failed)} of {len(commands)} failed: {failed}{tail}" if failed else None


def run_commands(commands: list[str], scratch: Path) -> str | None:
    """Run ``commands`` in one runner process (``python -m tests.test_readme_commands <plan>``) in ``scratch``;
    :func:`runner_verdict` of it. The runner's log is kept in ``<scratch>/runner.log``."""
    plan = scratch / "plan.json"
    plan.write_text(json.dumps({"cwd": str(scratch), "commands": commands}))
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # tiny models: one thread, no spin-waiting on a busy machine (6x faster at load 12)
    proc = subprocess.run([sys.executable, "-m", "tests.test_readme_commands", str(plan)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    log = proc.stdout + proc.stderr
    (scratch / "runner.log").write_text(log)
    results_file = Path(str(plan) + ".results.json")
    results = json.loads(results_file.read_text()) if results_file.is_file() else None
    return runner_verdict(proc.returncode, results, commands, log)


def test_a_runner_that_crashes_says_so_with_its_traceback(tmp_path):
    (tmp_path / "data").write_text("a file where the runner makes its data folder")
    verdict = run_commands(["python run.py plan=true"], tmp_path)
    assert verdict is not None and "the runner wrote no results file (exit code 1)" in verdict
    assert "Traceback" in verdict and "FileExistsError" in verdict, verdict


@pytest.mark.parametrize("returncode,results,expected", [
    (0, [], "the runner exited 0 after 0 of 2 commands (0 of them failed: [])"),
    (1, [{"command": "a", "rc": 0}], "the runner crashed (exit code 1) after 1 of 2 commands (0 of them failed"),
    (0, [{"command": "a", "rc": 0}, {"command": "b", "rc": 2}], "1 of 2 failed: ['b']"),
    (0, [{"command": "a", "rc": 0}, {"command": "b", "rc": 0}], None),
])
def test_runner_verdict_counts_what_did_not_run(returncode, results, expected):
    verdict = runner_verdict(returncode, results, ["a", "b"], "the log")
    assert verdict == expected if expected is None else verdict.startswith(expected) and verdict.endswith("the log")


@pytest.mark.slow
def test_every_runnable_readme_command_exits_0(tmp_path):
    verdict = run_commands([c for c in readme_commands() if c not in NOT_RUNNABLE], tmp_path)
    assert verdict is None, verdict

if __name__ == "__main__":
    run_plan(Path(sys.argv[1]))
