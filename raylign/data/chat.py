"""Chat conversations: validating ``messages`` and tokenising them with a mask on assistant turns.

The mask is 1 on the tokens the model should learn to produce: each assistant message's
content and its end-of-turn token, as rendered by the tokenizer's chat template. Templates
that mark assistant text with ``{% generation %}`` give the mask directly; for other
templates it is found by rendering growing prefixes of the conversation, which needs a
template whose rendering of a shorter conversation is a prefix of the longer one.
"""

from __future__ import annotations

import re
from typing import Any

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from raylign.data.errors import DataError, RowRef
from raylign.data.rows import check_text

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
# Message fields chat templates render (tool use, reasoning) that a {role, content} message would drop.
DROPPED_FIELDS = ("tool_calls", "tool_call_id", "function_call", "reasoning_content", "thinking")
Message = dict[str, str]


def validate_messages(value: Any, key: str, where: RowRef) -> list[Message]:
    """Check a conversation: a non-empty list of {role, content} with known roles and non-empty text."""
    if not isinstance(value, list):
        raise where.error(key, f"expected a list of messages, got {type(value).__name__}: {value!r:.80}", "wrong_type")
    if not value:
        raise where.error(key, "empty list of messages", "empty_text")
    messages = []
    for i, message in enumerate(value):
        item = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise where.error(item, f"expected a {{role, content}} object, got {type(message).__name__}", "wrong_type")
        if "role" not in message or "content" not in message:
            raise where.error(item, f"a message needs 'role' and 'content' (has {sorted(message)})", "missing_key")
        dropped = [field for field in DROPPED_FIELDS if message.get(field) not in (None, "", [])]
        if dropped:
            raise where.error(
                f"{item}.{dropped[0]}",
                "messages are trained on as role and content only, and this would be dropped: write it into "
                "the content, or remove the field",
                "unread_key",
            )
        role = message["role"]
        if role not in ALLOWED_ROLES:
            raise where.error(f"{item}.role", f"unknown role {role!r}; allowed: {', '.join(ALLOWED_ROLES)}", "bad_role")
        messages.append({"role": role, "content": check_text(message["content"], f"{item}.content", where)})
    return messages


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template marks assistant text with ``{% generation %}`` blocks."""
    template = tokenizer.chat_template
    return isinstance(template, str) and _GENERATION_TAG.search(template) is not None


def _render_ids(tokenizer: PreTrainedTokenizerBase, messages: list[Message], **kwargs: Any) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(encoded["input_ids"])


def _mask_from_generation_markers(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message]
) -> tuple[list[int], list[int]]:
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(encoded["input_ids"]), list(encoded["assistant_masks"])


def _mask_from_prefixes(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message]
) -> tuple[list[int], list[int]] | None:
    """Assistant turn i spans render(messages[:i], generation prompt) .. render(messages[:i+1]).

    The span ends at its last eos token when it has one, so separators the template puts
    after the end-of-turn token (a newline in ChatML) are not trained on. Returns None when a
    rendered prefix is not a prefix of the whole conversation's tokens.
    """
    ids = _render_ids(tokenizer, messages)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_ids(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render_ids(tokenizer, messages[: i + 1])
        if ids[: len(before)] != before or ids[: len(through)] != through or len(before) > len(through):
            return None
        span = through[len(before) :]
        if tokenizer.eos_token_id in span:
            span = span[: len(span) - span[::-1].index(tokenizer.eos_token_id)]
        mask[len(before) : len(before) + len(span)] = [1] * len(span)
    return ids, mask


def _count_spans(mask: list[int]) -> int:
    return sum(1 for t, m in enumerate(mask) if m and (t == 0 or not mask[t - 1]))


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], key: str, where: RowRef
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask that is 1 on assistant tokens."""
    if not tokenizer.chat_template:
        raise DataError(f"{where.source}: the tokenizer has no chat template; set data.format to 'plain'")
    markers = has_generation_markers(tokenizer)
    if not markers and messages[0]["role"] == "assistant":
        # Its span would start after the rendering of no messages, which templates refuse to render.
        raise where.error(
            key,
            "the conversation starts with an assistant message, and without {% generation %} markers in the "
            "chat template an assistant turn is located after the conversation before it, of which there is "
            "none; start with a system or user message, or use a template with generation markers",
            "assistant_first",
        )
    try:
        encoded = (
            _mask_from_generation_markers(tokenizer, messages) if markers else _mask_from_prefixes(tokenizer, messages)
        )
    except (TemplateError, ValueError) as err:  # transformers raises ValueError for some conversations it refuses
        raise where.error(key, f"the chat template rejected this conversation: {err}", "template_error") from None
    if encoded is None:
        # A row error, not a dataset error: the text of one row can cause it (a reply starting with a newline
        # merges with the newline ending the assistant header in tokenizers such as Qwen's), so
        # data.skip_bad_rows skips and counts such rows.
        raise where.error(
            key,
            "the tokenizer's chat template renders this conversation differently from its beginnings (a reply "
            "whose first characters merge into one token with the end of the assistant header?), so assistant "
            "turns cannot be located; use a template with {% generation %} markers or data.format 'plain'",
            "template_mismatch",
        )
    ids, mask = encoded
    assistant_turns = sum(m["role"] == "assistant" for m in messages)
    if _count_spans(mask) != assistant_turns:
        raise DataError(
            f"{where.source}, row {where.row}: the chat template marked {_count_spans(mask)} assistant spans for "
            f"{assistant_turns} assistant messages; its generation markers do not match the assistant turns"
        )
    return ids, mask
