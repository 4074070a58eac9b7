"""Every MoE model type of the installed transformers is supported, refused or not looked at; the support matrix page
(docs/families.md) is the code's."""

from __future__ import annotations

from html.parser import HTMLParser

import markdown as python_markdown
import pytest

import moe_lab
from moe_lab import families
from moe_lab.moe.registry import FAMILIES, supported_families
from tests.conftest import ROOT, build_tiny


def test_every_moe_model_type_has_a_state():
    states = families.family_states()
    unknown = sorted(t for t, (state, _) in states.items() if state == "unknown")
    assert not unknown, f"new MoE model types in transformers, in no state: {unknown}"
    # the static scan finds every registry family (each builds its sparse-MoE block under self.experts)
    assert set(supported_families()) <= set(states)
    assert len(states) >= len(FAMILIES) + len(families.REFUSED)


def test_refused_and_not_looked_at_are_current_and_disjoint():
    moe = set(families.moe_model_types())
    listed = set(families.REFUSED) | set(families.NOT_LOOKED_AT)
    assert not set(families.REFUSED) & set(families.NOT_LOOKED_AT)
    assert not listed & set(FAMILIES), "a supported family is also listed as refused / not looked at"
    assert listed <= moe, f"no longer MoE causal-LM model types: {sorted(listed - moe)}"
    assert all(reason.strip() for reason in (*families.REFUSED.values(), *families.NOT_LOOKED_AT.values()))


def test_docs_matrix_is_current():
    text = families.MATRIX_PAGE.read_text(encoding="utf-8")
    assert families.with_matrix(text) == text, "run: python -m moe_lab.families --write-docs"
    assert "docs/families.md" in (ROOT / "README.md").read_text(encoding="utf-8"), "the README links the matrix"


def test_write_docs_replaces_only_the_matrix_block(tmp_path, monkeypatch, capsys):
    page = tmp_path / "families.md"
    page.write_text(f"intro\n{families.MATRIX_BEGIN}\nstale\n{families.MATRIX_END}\noutro\n", encoding="utf-8")
    monkeypatch.setattr(families, "MATRIX_PAGE", page)
    assert families.main(["--write-docs"]) == 0
    text = page.read_text(encoding="utf-8")
    assert text == f"intro\n{families.MATRIX_BEGIN}\n{families.markdown()}\n{families.MATRIX_END}\noutro\n"
    assert families.main(["--write-readme"]) == 0 and page.read_text(encoding="utf-8") == text
    assert "--write-readme is now --write-docs" in capsys.readouterr().out
    page.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="families.md lacks the markers"):
        families.with_matrix(page.read_text(encoding="utf-8"))


class _CellText(HTMLParser):
    """The text of each ``<td>`` as a browser shows it: tags dropped, entities decoded."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.cells, self._open = [], False

    def handle_starttag(self, tag, attrs):
        if tag == "td":
            self.cells.append("")
            self._open = True

    def handle_endtag(self, tag):
        self._open = self._open and tag != "td"

    def handle_data(self, data):
        if self._open:
            self.cells[-1] += data


@pytest.mark.parametrize("text", ["dL/dw_e = <dL/dy, E_e(x)> is the derivative", "from_pretrained(<llama4 checkpoint>)",
                                  "a | b", "AT&T, &lt; as typed", "to_dense -> mlp (k < 4)"])
def test_table_cell_renders_as_its_text(text):
    """Rendered by Python-Markdown (mkdocs' own) and read as a browser does, the cell is the text: nothing taken
    for a tag, no split cell."""
    parser = _CellText()
    parser.feed(python_markdown.markdown(f"| h |\n|---|\n| {families.table_cell(text)} |", extensions=["tables"]))
    assert parser.cells == [text]


def test_matrix_cells_come_from_the_method_checks():
    markdown = families.markdown()
    row = next(line for line in markdown.splitlines() if line.startswith("| phimoe |"))
    assert "no: sparsemixer routing already has its own router-gradient estimator" in row
    gpt_oss = next(line for line in markdown.splitlines() if line.startswith("| gpt_oss |"))
    assert gpt_oss.rstrip(" |").endswith("no: condensed layers compute act(gate) * up on the layout's role views, "
                                         "without expert biases (GPT-OSS's clamped GLU with biases is not implemented) "
                                         "| yes")


@pytest.mark.parametrize("method,match", [("densemixer", "densemixer is not defined for phimoe: sparsemixer"),
                                          ("condenser", "condenser is not defined for phimoe: selection biases")])
def test_undefined_method_is_refused_by_name(method, match):
    with pytest.raises(ValueError, match=match):
        moe_lab.apply(build_tiny("phimoe"), method)


def test_llama4_text_supported_and_the_composite_refused_with_the_way_to_its_text_decoder():
    states = families.family_states()
    assert states["llama4_text"][0] == "supported"
    state, reason = states["llama4"]
    assert state == "refused" and "model_type llama4_text, supported" in reason and "AutoModelForCausalLM" in reason
    row = next(line for line in families.markdown().splitlines() if line.startswith("| llama4_text |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert dict(zip(families.COLUMNS, (c.split(":")[0] for c in cells))) == {
        "conformance": "bit-exact (fp32, bf16)", "sft": "yes", "frozen_router": "yes", "esft": "yes",
        "densemixer": "no", "condenser": "yes", "compressed_experts": "no", "lora": "yes",
        "calibrate/to_dense/prune": "calibrate, prune (reap", "condense": "no", "kd": "yes"}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_llama4_text", "tiny_dbrx", "tiny_aria_text"])
def test_added_family_runs_end_to_end_through_run_py(model, tmp_path):
    """``python run.py model=<the family's tiny sibling> debug=fast``, as a user types it: trains, prints the summary,
    and its export loads in vanilla transformers as the family's model (the families added last)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.test_run import run_py

    out = tmp_path / "run"
    proc = run_py(f"model={model}", "debug=fast", "logger=csv", f"hydra.run.dir={out}", cwd=tmp_path)
    assert f"model / method  {model} / sft" in proc.stdout
    vanilla = AutoModelForCausalLM.from_pretrained(out / "export").eval()
    ids = torch.arange(3, 19).view(2, 8)
    with torch.no_grad():
        logits = vanilla(input_ids=ids).logits
    assert torch.isfinite(logits).all() and logits.shape == (2, 8, vanilla.config.vocab_size)
    assert vanilla.config.model_type == model.removeprefix("tiny_")
