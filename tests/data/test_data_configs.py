"""Every conf/dataset config composes, instantiates, names a real source, and fails offline with the override."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from moe_lab.data import sources
from moe_lab.data.datamodule import SFTDataModule
from moe_lab.data.mmlu import MMLUDataModule
from moe_lab.data.sharegpt import ShareGPTDataModule
from moe_lab.data.templated import PromptCompletionDataModule
from moe_lab.data.text import TextBlockDataModule
from moe_lab.data.tokenizer import build_byte_tokenizer

CONF = Path(__file__).resolve().parents[2] / "conf" / "dataset"
LLM_ADAPTERS = "https://raw.githubusercontent.com/AGI-Edgerunners/LLM-Adapters/main/ft-training_set/"
ESFT = "https://raw.githubusercontent.com/deepseek-ai/ESFT/main/datasets/train/"
# name -> (DataModule, source or None for text, path, hub config name)
REMOTE = {
    "math7k": (SFTDataModule, "llm_adapters", LLM_ADAPTERS + "math_7k.json", None),
    "math10k": (SFTDataModule, "llm_adapters", LLM_ADAPTERS + "math_10k.json", None),
    "math14k": (SFTDataModule, "llm_adapters", LLM_ADAPTERS + "math_14k.json", None),
    "commonsense15k": (SFTDataModule, "llm_adapters", LLM_ADAPTERS + "commonsense_15k.json", None),
    "commonsense170k": (SFTDataModule, "llm_adapters", LLM_ADAPTERS + "commonsense_170k.json", None),
    "mathinstruct": (SFTDataModule, "llm_adapters", "TIGER-Lab/MathInstruct", None),
    "tulu3": (SFTDataModule, "chat", "allenai/tulu-3-sft-mixture", None),
    "esft_intent": (SFTDataModule, "chat", ESFT + "intent.jsonl", None),
    "esft_law": (SFTDataModule, "chat", ESFT + "law.jsonl", None),
    "esft_summary": (SFTDataModule, "chat", ESFT + "summary.jsonl", None),
    "esft_translation": (SFTDataModule, "chat", ESFT + "translation.jsonl", None),
    "s1k": (SFTDataModule, "reasoning", "simplescaling/s1K", None),
    "gsm8k_train": (PromptCompletionDataModule, "llm_adapters", "openai/gsm8k", "main"),
    "codealpaca": (PromptCompletionDataModule, "llm_adapters", "sahil2801/CodeAlpaca-20k", None),
    "nemotron_code": (ShareGPTDataModule, "chat", "autoprogrammer/nemotron_code_lf_filtered", None),
    "magicoder": (PromptCompletionDataModule, "llm_adapters", "ise-uiuc/Magicoder-Evol-Instruct-110K", None),
    "mmlu_train": (MMLUDataModule, "llm_adapters", "cais/mmlu", "auxiliary_train"),
    "fineweb_edu": (TextBlockDataModule, None, "HuggingFaceFW/fineweb-edu", "sample-10BT"),
    "c4": (TextBlockDataModule, None, "allenai/c4", "en"),
    "wikitext2": (TextBlockDataModule, None, "Salesforce/wikitext", "wikitext-2-raw-v1"),
    "wikitext103": (TextBlockDataModule, None, "Salesforce/wikitext", "wikitext-103-raw-v1"),
}
GENERIC = {"llm_adapters", "chat", "text", "sharegpt"}  # path: ??? (set by the user)
LOCAL = {"synthetic_math", "math_data"}


def _compose(name, overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def test_every_config_is_listed():
    assert {p.stem for p in CONF.glob("*.yaml")} == set(REMOTE) | GENERIC | LOCAL


@pytest.mark.parametrize("name", sorted(REMOTE))
def test_config_instantiates_with_its_source(name):
    cls, source, path, hub_name = REMOTE[name]
    cfg = _compose(name)
    assert (cfg.path, cfg.name) == (path, hub_name)
    dm = instantiate(cfg, tokenizer=build_byte_tokenizer())
    assert type(dm) is cls and dm.path == path
    if source is not None:
        assert dm.source == source and dm.overflow == "truncate" and dm.packing is False
    if name.startswith("esft_"):
        assert dm.chat_format == "plain" and dm.max_length == 4096
    if name == "s1k":
        assert dm.reasoning.trace_field == "thinking_trajectories" and dm.max_length == 32768


@pytest.mark.parametrize("name", sorted(REMOTE))
def test_offline_source_names_the_local_override(name, monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("network is unreachable")

    monkeypatch.setattr(sources, "load_dataset", offline)
    dm = instantiate(_compose(name), tokenizer=build_byte_tokenizer())
    with pytest.raises(OSError) as info:
        dm.setup()
        next(iter(dm.train_dataloader()))  # a stream is opened lazily
    message = str(info.value)
    assert REMOTE[name][2] in message and "dataset.path=/local/" in message


@pytest.mark.parametrize("name", ["s1k", "math7k", "wikitext2"])
def test_real_offline_hub_and_url_fail_fast(name, monkeypatch):
    """Through the real `datasets` in offline mode (set here: the flag is read when huggingface_hub is imported)."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    dm = instantiate(_compose(name), tokenizer=build_byte_tokenizer())
    with pytest.raises(OSError, match="dataset.path=/local/"):
        dm.setup()


def test_local_override_reads_a_file(tmp_path):
    path = tmp_path / "intent.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n' * 3)
    dm = instantiate(_compose("esft_intent", [f"path={path}"]), tokenizer=build_byte_tokenizer())
    dm.setup()
    assert len(dm.rows["train"]) + len(dm.rows["val"]) == 3
    with pytest.raises(FileNotFoundError, match="dataset.path=/local/"):
        instantiate(_compose("tulu3", [f"path={tmp_path / 'missing.jsonl'}"]), tokenizer=build_byte_tokenizer()).setup()
