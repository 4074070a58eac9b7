"""Tables and the figure of ``task=estimate`` (estimate.json -> estimate.md / .csv / .png)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from .report import markdown_table, save_figure, write_csv

LABELS = {"sft": "SFT", "densemixer": "DenseMixer", "condenser_replace": "Condenser (replace)",
          "condenser_append": "Condenser (append)", "compressed_experts": "Compressed Experts", "esft": "ESFT",
          "lora": "LoRA", "kd": "KD (teacher + student)", "dense_student": "Dense student"}


def method_rows(result: dict) -> list[dict]:
    return [{"method": name, "gflops_fwd_per_token": m["flops_per_token_forward"] / 1e9,
             "gflops_bwd_per_token": m["flops_per_token_backward"] / 1e9, "ratio_to_sft": m["ratio_to_sft"],
             "params_total": m["params_total"], "params_active": m["params_active"],
             "params_active_no_input_embedding": m["params_active_no_input_embedding"],
             "params_trainable": m["params_trainable"]} for name, m in result["methods"].items()]


def memory_rows(result: dict) -> list[dict]:
    return [{"method": name, **row} for name, m in result["methods"].items() for row in m["memory"]]


def write_tables(result: dict, out: Path, title: str) -> Path:
    rows, mem = method_rows(result), memory_rows(result)
    write_csv(rows, out / "estimate.csv")
    write_csv(mem, out / "estimate_memory.csv")
    r = result
    text = [f"# Cost estimate: {title}\n",
            (f"{r['tokens_per_step']:,} tokens per step (batch {r['batch']} x seq {r['seq_len']}); parameters total "
            f"{r['params_total']:,} (without input embedding {r['params_total_no_input_embedding']:,}), active "
            f"{r['params_active']:,} (without input embedding {r['params_active_no_input_embedding']:,}; without "
            f"both embeddings {r['params_active_no_embeddings']:,}); {r['moe_layers']} MoE layers of "
            f"{r['num_layers']}.\n"),
            markdown_table(rows, {"method": "method", "gflops_fwd_per_token": "GFLOP/token fwd",
                                  "gflops_bwd_per_token": "GFLOP/token bwd", "ratio_to_sft": "x SFT",
                                  "params_active": "active params", "params_trainable": "trainable params"},
                           {"gflops_fwd_per_token": ".3f", "gflops_bwd_per_token": ".3f", "ratio_to_sft": ".3f",
                            "params_active": ",", "params_trainable": ","}),
            "\nNotes: " + "; ".join(f"{LABELS[n]}: {m['note']}" for n, m in r["methods"].items()) + ".\n",
            "\n## Memory per GPU (GiB)\n",
            markdown_table([m for m in mem if m["method"] in ("sft", "densemixer", "esft", "lora")],
                           {"method": "method", "strategy": "strategy", "activation_checkpointing": "ckpt",
                            "params_gb": "params", "grads_gb": "grads", "optimizer_gb": "optimizer",
                            "activations_gb": "activations", "gpu_total_gb": "GPU total", "cpu_gb": "CPU"},
                           {k: ".1f" for k in ("params_gb", "grads_gb", "optimizer_gb", "activations_gb",
                                               "gpu_total_gb", "cpu_gb")})]
    if "unavailable" in r["dense_student"]:
        text.append(f"\nKD / dense student not estimated: {r['dense_student']['unavailable']}\n")
    path = out / "estimate.md"
    path.write_text("\n".join(text))
    return path


def figure(result: dict, path: Path, title: str) -> Path:
    """FLOPs per token by method (forward + backward, ratio to SFT) and GPU memory per rank by strategy (SFT)."""
    fig = Figure(figsize=(12, 4.6), dpi=150, layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=[1.25, 1])
    names = list(result["methods"])
    fwd = np.array([result["methods"][n]["flops_per_token_forward"] / 1e9 for n in names])
    bwd = np.array([result["methods"][n]["flops_per_token_backward"] / 1e9 for n in names])
    y = np.arange(len(names))[::-1]
    ax.barh(y, fwd, color="#4C72B0", label="forward")
    ax.barh(y, bwd, left=fwd, color="#DD8452", label="backward")
    for yi, n, total in zip(y, names, fwd + bwd):
        ax.text(total, yi, f"  {result['methods'][n]['ratio_to_sft']:.2f}x", va="center", fontsize=8)
    ax.set_yticks(y, [LABELS[n] for n in names], fontsize=9)
    ax.set_xlabel("GFLOP per token")
    ax.set_xlim(0, (fwd + bwd).max() * 1.15)
    ax.set_title(f"Training FLOPs per token (seq {result['seq_len']}), ratio to SFT", fontsize=10)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    rows = [r for r in result["methods"]["sft"]["memory"] if r["activation_checkpointing"]]
    parts = [("params_gb", "parameters", "#4C72B0"), ("grads_gb", "gradients", "#55A868"),
             ("optimizer_gb", "optimizer", "#C44E52"), ("activations_gb", "activations", "#8172B2")]
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for key, label, colour in parts:
        values = np.array([r[key] for r in rows])
        bx.bar(x, values, bottom=bottom, color=colour, label=label, width=0.65)
        bottom += values
    for xi, r in zip(x, rows):
        label = f"{r['gpu_total_gb']:.0f}" + (f"\n(+{r['cpu_gb']:.0f} on CPU)" if r["cpu_gb"] else "")
        bx.text(xi, r["gpu_total_gb"], label, ha="center", va="bottom", fontsize=8)
    bx.set_xticks(x, [r["strategy"] for r in rows], fontsize=9)
    bx.set_ylabel("GiB per GPU")
    bx.set_title(f"SFT memory per GPU ({rows[0]['gpus']} GPUs, activation checkpointing)", fontsize=10)
    bx.legend(fontsize=8, frameon=False)
    bx.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path)
