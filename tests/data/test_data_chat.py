import json

import pytest

from moe_lab.data.chat import chat_prompt_ids, chat_segments, resolve_chat_format
from moe_lab.data.collate import IGNORE_INDEX, assemble
from moe_lab.data.datamodule import SFTDataModule
from moe_lab.data.tokenizer import build_byte_tokenizer

BOS, EOS = 1, 2
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " 2+2? "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6 ✓"},
]


def b(text):
    return [x + 3 for x in text.encode()]


def _flat(segments):
    ids = [t for seg, _ in segments for t in seg]
    labels = [t if trained else IGNORE_INDEX for seg, trained in segments for t in seg]
    return ids, labels


def test_plain_format_by_hand():
    tok = build_byte_tokenizer()
    ids, labels = _flat(chat_segments(tok, CONVERSATION))  # byte tokenizer: no template -> plain fallback
    prompt1 = [BOS, *b("Be brief.\n\nUser: 2+2?\n\nAssistant:")]
    answer1 = [*b(" 4"), EOS]
    prompt2 = b("User: and 3+3?\n\nAssistant:")
    answer2 = [*b(" 6 ✓"), EOS]
    assert ids == prompt1 + answer1 + prompt2 + answer2
    n = IGNORE_INDEX
    assert labels == [n] * len(prompt1) + answer1 + [n] * len(prompt2) + answer2


def test_masked_assistant_turn_is_context_only():
    tok = build_byte_tokenizer()
    conversation = [dict(m) for m in CONVERSATION]
    conversation[2]["mask"] = True
    ids, labels = _flat(chat_segments(tok, conversation))
    assert ids == _flat(chat_segments(tok, CONVERSATION))[0]
    assert [t for t in labels if t != IGNORE_INDEX] == [*b(" 6 ✓"), EOS]
    conversation[4]["mask"] = True  # nothing trained at all: dropped as "no_labels"
    assert assemble(chat_segments(tok, conversation), 1000)[1] == "no_labels"


def test_template_assistant_spans_by_string_search():
    tok = build_byte_tokenizer()
    tok.chat_template = TEMPLATE
    ids, labels = _flat(chat_segments(tok, CONVERSATION))
    full = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == [BOS, *b(full)]
    # independent: the trained characters are each assistant content plus its "<|end|>"
    trained = [False] * len(full.encode())
    for answer in ("4<|end|>", "6 ✓<|end|>"):
        start = len(full[: full.index("<|assistant|>" + answer) + len("<|assistant|>")].encode())
        trained[start : start + len(answer.encode())] = [True] * len(answer.encode())
    assert labels == [IGNORE_INDEX] + [t if m else IGNORE_INDEX for t, m in zip(b(full), trained)]


def test_generation_prompt_matches_training_prefix():
    tok = build_byte_tokenizer()
    for template, last_turn in ((None, [*b(" 6 ✓"), EOS]), (TEMPLATE, b("6 ✓<|end|>"))):
        tok.chat_template = template
        ids, _ = _flat(chat_segments(tok, CONVERSATION))
        assert ids[-len(last_turn):] == last_turn
        assert chat_prompt_ids(tok, CONVERSATION[:4]) == ids[: -len(last_turn)]


def test_template_that_rewrites_history_is_rejected():
    tok = build_byte_tokenizer()
    tok.chat_template = "{{ messages | length }}" + TEMPLATE  # the count at the front changes every turn
    with pytest.raises(ValueError, match="chat_format=plain"):
        chat_segments(tok, CONVERSATION)


def test_chat_format_choice():
    tok = build_byte_tokenizer()
    assert resolve_chat_format(tok, "auto") == "plain"
    with pytest.raises(ValueError, match="no chat template"):
        resolve_chat_format(tok, "template")
    tok.chat_template = TEMPLATE
    assert resolve_chat_format(tok, "auto") == "template" and resolve_chat_format(tok, "plain") == "plain"
    with pytest.raises(ValueError, match="auto, template, plain"):
        resolve_chat_format(tok, "chatml")
    # ESFT's plain format even when the tokenizer has a template
    ids, _ = _flat(chat_segments(tok, CONVERSATION, chat_format="plain"))
    assert ids[:4] == [BOS, *b("Be ")]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(path)


def _ok(i):
    return {"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


@pytest.mark.parametrize(
    ("bad", "error", "field"),
    [
        ({"id": "x"}, ValueError, "'messages'"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, ValueError, "'messages[0].role'"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]}, TypeError,
         "'messages[1].content'"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, ValueError, "'messages[0].role'"),
        ({"messages": [{"role": "user", "content": "q"}]}, ValueError, "no assistant message"),
        ({"messages": ["hello"]}, TypeError, "'messages[0]'"),
    ],
)
def test_malformed_chat_row_names_file_line_and_field(tmp_path, bad, error, field):
    path = _write_jsonl(tmp_path / "esft_like.jsonl", [_ok(0), _ok(1), bad, _ok(3)])
    dm = SFTDataModule(source="chat", path=path, tokenizer=build_byte_tokenizer())
    with pytest.raises(error) as info:
        dm.setup()
    assert "esft_like.jsonl: row 2 starting at line 3" in str(info.value) and field in str(info.value)


def test_chat_datamodule_trains_on_assistant_turns_only(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", [_ok(i) for i in range(20)])
    dm = SFTDataModule(source="chat", path=path, max_length=64, batch_size=4, val_fraction=0.1,
                       tokenizer=build_byte_tokenizer())
    dm.setup()
    assert len(dm.examples["train"]) == 18 and len(dm.examples["val"]) == 2
    for ex, row in zip(dm.examples["train"], dm.rows["train"]):
        i = row["id"][1:]
        assert ex["input_ids"] == [BOS, *b(f"User: q{i}\n\nAssistant:"), *b(f" a{i}"), EOS]
        assert [t for t in ex["labels"] if t != IGNORE_INDEX] == [*b(f" a{i}"), EOS]
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"} and batch["input_ids"].shape[0] == 4
