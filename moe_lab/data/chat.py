"""Chat rows (``messages``): validation, and tokenization with the loss on assistant turns only.

Two renderings:

- ``template``: the tokenizer's chat template. Each assistant turn is found by rendering the conversation
  up to it twice (``messages[:i]`` with the generation prompt, then ``messages[:i+1]``); the difference is
  the turn's trained text (its content and the template's end-of-turn marker). The template must be
  prefix-stable (an earlier rendering is a prefix of a later one); a template that rewrites history (e.g.
  dropping earlier reasoning) is reported with the fix ``dataset.chat_format=plain``.
- ``plain``: DeepSeek's plain format used by ESFT (deepseek-ai/ESFT ``utils.py``), also the fallback for
  tokenizers without a chat template such as moe-lab's byte tokenizer:

  ```text
  <bos>[system content\\n\\n]User: {user}\\n\\nAssistant: {assistant}<eos>User: ...
  ```

  Contents are stripped; the trained part of an assistant turn is `` {assistant}`` plus the eos token.

Pieces are tokenized separately and concatenated, so the prompt of a turn is tokenized exactly as
``encode_prompt`` tokenizes it at generation time. An assistant message with ``"mask": 1`` (ESFT's
convention) is kept in the context but not trained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from moe_lab.data.collate import text_ids, with_bos
from moe_lab.data.sources import where

ROLES = ("system", "user", "assistant")
#: ``dataset.chat_format``: ``auto`` = the tokenizer's template when it has one, else ``plain``.
CHAT_FORMATS = ("auto", "template", "plain")

Segments = list[tuple[list[int], bool]]


def validate_chat_row(row: Mapping[str, Any], source: str, i: int, field: str = "messages",
                      keys: tuple[str, str] = ("role", "content"), roles: Mapping[str, str] | None = None) -> list[dict]:
    """The row's messages as ``[{"role", "content", "mask"}]``; a malformed row raises naming row/line/field.

    ``keys``: the role and content keys of a message (ShareGPT: ``("from", "value")``); ``roles``: the accepted
    role tags mapped to chat roles (default: the chat roles themselves)."""
    role_key, content_key = keys
    roles = roles or {r: r for r in ROLES}
    noun = "messages" if keys == ("role", "content") else "turns"
    messages = row.get(field)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where(source, i)}: field '{field}' must be a non-empty list of {noun}, got "
                         f"{messages!r:.200}")
    out = []
    for j, message in enumerate(messages):
        name = f"{field}[{j}]"
        if not isinstance(message, Mapping):
            raise TypeError(f"{where(source, i)}: field '{name}' must be an object with {role_key} and {content_key}")
        role, content = message.get(role_key), message.get(content_key)
        if role not in roles:
            raise ValueError(f"{where(source, i)}: field '{name}.{role_key}' must be one of {', '.join(roles)}, "
                             f"got {role!r}")
        if not isinstance(content, str):
            raise TypeError(f"{where(source, i)}: field '{name}.{content_key}' must be a string, got {content!r:.200}")
        role = roles[role]
        out.append({"role": role, "content": content, "mask": bool(message.get("mask") or 0)})
    if out[0]["role"] == "assistant":
        raise ValueError(f"{where(source, i)}: field '{field}[0].role' is 'assistant'; a conversation starts "
                         "with a system or user turn")
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where(source, i)}: field '{field}' has no assistant message, nothing to train on")
    return out


def validate_chat_rows(rows: Sequence[Mapping[str, Any]], source: str, field: str = "messages") -> list[dict]:
    """``validate_chat_row`` over all rows: each output row is ``{"messages": [...], **other fields}``."""
    return [{**row, "messages": validate_chat_row(row, source, i, field)} for i, row in enumerate(rows)]


def resolve_chat_format(tokenizer: Any, chat_format: str) -> str:
    """``template`` or ``plain`` for this tokenizer (``auto``: template when the tokenizer has one)."""
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"dataset.chat_format must be one of {', '.join(CHAT_FORMATS)}, got {chat_format!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_format == "template" and not has_template:
        raise ValueError("dataset.chat_format=template but the tokenizer has no chat template; use "
                         "dataset.chat_format=plain (or auto) for the plain 'User: ... Assistant: ...' format")
    if chat_format == "auto":
        return "template" if has_template else "plain"
    return chat_format


def plain_segments(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> Segments:
    """Segments of the plain format (see module docstring); bos first, eos after every assistant turn."""
    segments: Segments = []
    pending = ""
    for m in messages:
        content = m["content"].strip()
        if m["role"] == "system":
            pending += f"{content}\n\n"
        elif m["role"] == "user":
            pending += f"User: {content}\n\nAssistant:"
        else:
            answer = text_ids(tokenizer, f" {content}")
            if tokenizer.eos_token_id is not None:
                answer.append(tokenizer.eos_token_id)
            segments += [(text_ids(tokenizer, pending), False), (answer, not m.get("mask"))]
            pending = ""
    if pending:  # turns after the last assistant turn: context only
        segments.append((text_ids(tokenizer, pending), False))
    return segments


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=generation_prompt)


def template_segments(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> Segments:
    """Segments from the tokenizer's chat template; trained text = each assistant turn's rendered difference."""
    segments: Segments = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], generation_prompt=True)
        full = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ValueError(
                f"The tokenizer's chat template is not prefix-stable at message {i}: rendering the conversation "
                "up to an assistant turn does not extend the rendering before it, so the assistant tokens cannot "
                "be located. Use dataset.chat_format=plain."
            )
        segments += [(text_ids(tokenizer, prompt[len(done):]), False),
                     (text_ids(tokenizer, full[len(prompt):]), not m.get("mask"))]
        done = full
    return segments


def chat_segments(tokenizer: Any, messages: Sequence[Mapping[str, Any]], chat_format: str = "auto") -> Segments:
    """``(ids, trained)`` segments of a conversation: only assistant turns (not masked) are trained.

    The first segment starts with bos when the tokenizer has one (unless the template wrote it).
    """
    fmt = resolve_chat_format(tokenizer, chat_format)
    segments = plain_segments(tokenizer, messages) if fmt == "plain" else template_segments(tokenizer, messages)
    while segments and not segments[-1][1]:  # nothing after the last trained turn is needed
        segments.pop()
    if segments:
        segments[0] = (with_bos(tokenizer, segments[0][0]), segments[0][1])
    return segments


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], chat_format: str = "auto") -> list[int]:
    """Token ids that ask for the next assistant turn after ``messages`` (generation), as training builds them."""
    if resolve_chat_format(tokenizer, chat_format) == "template":
        return with_bos(tokenizer, text_ids(tokenizer, _render(tokenizer, messages, generation_prompt=True)))
    ids = [t for seg, _ in plain_segments(tokenizer, messages) for t in seg]
    return with_bos(tokenizer, ids)
