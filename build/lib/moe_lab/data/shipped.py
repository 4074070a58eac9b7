"""The data files shipped inside the package: the LLM-Adapters evaluation sets and math_data.json.

They come from the LLM-Adapters repository (Hu et al. 2023, AGI-Edgerunners/LLM-Adapters, Apache-2.0; the
licence is ``files/llm_adapters/LICENSE.LLM-Adapters``). ``paths.data_dir`` (``eval.data_dir``) defaults to
this folder; ``$MOE_LAB_DATA_DIR`` or ``paths.data_dir=/abs/folder`` points elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

#: the packaged LLM-Adapters folder (fourteen ``*.test.json`` evaluation sets and ``math_data.json``)
LLM_ADAPTERS_DIR = Path(__file__).resolve().parent / "files" / "llm_adapters"


def shipped_data_dir(name: str = "llm_adapters") -> str:
    """The packaged data folder ``name`` (``${moe_lab.shipped_data:llm_adapters}`` in the configs)."""
    folder = Path(__file__).resolve().parent / "files" / str(name)
    if not folder.is_dir():
        raise ValueError(f"moe_lab.shipped_data:{name}: no such packaged data folder (known: llm_adapters)")
    return str(folder)


if not OmegaConf.has_resolver("moe_lab.shipped_data"):
    OmegaConf.register_new_resolver("moe_lab.shipped_data", shipped_data_dir)
