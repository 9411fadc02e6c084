"""Supervised fine-tuning data: rows to token ids with a loss mask, and the train/eval sample lists.

A :class:`Sample`'s ``loss_mask[t] == 1`` means token ``t`` is a training target, predicted
from tokens ``< t``; the first token is never a target. Chat rows (``messages``, or an
input/output pair turned into a user/assistant exchange) are rendered with the tokenizer's
chat template and train on every assistant turn including its end-of-turn token. Plain rows
are ``prompt_template.format(input=...) + output + eos`` and train on ``output + eos``.
With ``loss='full'`` every token after the first is a target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from raylign.config.data import DataConfig, DatasetSpec
from raylign.data.chat import Message, tokenize_conversation, validate_messages
from raylign.data.errors import DataError, RowError, RowRef
from raylign.data.formatting import encode_plain, truncate_prompt_response
from raylign.data.rows import (
    DataStats,
    build_splits,
    check_text,
    collect_samples,
    optional_text,
    refuse_system_beside_conversation,
    require_text,
)


@dataclass
class Sample:
    """One tokenised training sequence and where it came from (1-based row number in ``source``)."""

    input_ids: list[int]
    loss_mask: list[int]
    source: str
    row: int
    truncated: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_target_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class SFTData:
    """Train and eval samples, and what happened to the rows of every file read."""

    train: list[Sample]
    eval: list[Sample]
    stats: DataStats = field(default_factory=DataStats)


def _chat_messages(row: dict[str, Any], spec: DatasetSpec, where: RowRef) -> tuple[list[Message], str]:
    """The conversation of a chat row, and the key to name in errors about it."""
    if row.get(spec.messages_key) is not None:
        refuse_system_beside_conversation(row, spec.system_key, spec.messages_key, where)
        messages = validate_messages(row[spec.messages_key], spec.messages_key, where)
        _check_texts_beside_conversation(row, spec, messages, where)
        return messages, spec.messages_key
    prompt = require_text(row, spec.input_key, where)
    response = require_text(row, spec.output_key, where)
    system = optional_text(row, spec.system_key, where)
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return messages, spec.output_key


def _check_texts_beside_conversation(
    row: dict[str, Any], spec: DatasetSpec, messages: list[Message], where: RowRef
) -> None:
    """The conversation is what is trained on. A prompt or completion key beside it must say the same,
    or it would be dropped without a word: the prompt as the conversation before its last assistant
    message (``raylign select`` writes it so) or as its first user turn's text (UltraChat keeps that);
    the completion as its last assistant turn's text."""
    last_reply = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    users = [m["content"] for m in messages if m["role"] == "user"]
    given = row.get(spec.input_key)
    if given is not None:
        if isinstance(given, list):
            agrees = last_reply is not None and validate_messages(given, spec.input_key, where) == messages[:last_reply]
        else:
            agrees = bool(users) and check_text(given, spec.input_key, where).strip() == users[0].strip()
        if not agrees:
            raise _differs(
                spec,
                spec.input_key,
                "the conversation before its last assistant message, nor its first user message",
                where,
            )
    given = row.get(spec.output_key)
    if given is not None:
        reply = messages[last_reply]["content"] if last_reply is not None else None
        if reply is None or check_text(given, spec.output_key, where).strip() != reply.strip():
            raise _differs(spec, spec.output_key, "its last assistant message", where)


def _differs(spec: DatasetSpec, key: str, what: str, where: RowRef) -> RowError:
    return where.error(
        key,
        f"beside the conversation in {spec.messages_key!r}, which is what is trained on, and not {what}: "
        "remove it, or train on prompt/completion rows without the conversation",
        "different_prompts",
    )


def _chat_tokens(
    row: dict[str, Any], spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase, where: RowRef
) -> tuple[list[int], list[int], str]:
    messages, key = _chat_messages(row, spec, where)
    ids, mask = tokenize_conversation(tokenizer, messages, key, where)
    return ids, mask, key


def _plain_tokens(
    row: dict[str, Any], spec: DatasetSpec, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, where: RowRef
) -> tuple[list[int], list[int], str]:
    text = require_text(row, spec.input_key, where)
    # A pretraining-style row ('full' loss) may be a single document without an output.
    if cfg.loss == "full" and row.get(spec.output_key) is None:
        response = None
    else:
        response = require_text(row, spec.output_key, where)
    ids, prompt_len = encode_plain(tokenizer, cfg.prompt_template.format(input=text), response, cfg.add_eos)
    mask = [0] * prompt_len + [1] * (len(ids) - prompt_len)
    return ids, mask, spec.output_key


def _fit_length(
    ids: list[int], mask: list[int], key: str, cfg: DataConfig, where: RowRef
) -> tuple[list[int], list[int], bool]:
    """Apply the truncation policy; returns the ids, the mask and whether they were cut."""
    if len(ids) <= cfg.max_length:
        return ids, mask, False
    problem = f"{len(ids)} tokens, over data.max_length={cfg.max_length}"
    if cfg.truncation == "error":
        raise where.error(key, f"{problem} (data.truncation='error'; use 'truncate' or 'drop')", "too_long")
    if cfg.truncation == "drop":
        raise where.dropped(key, f"{problem}; dropped (data.truncation='drop')", "too_long")
    if cfg.loss == "full":
        return ids[: cfg.max_length], mask[: cfg.max_length], True
    prompt_len = mask.index(1)
    ids, mask = truncate_prompt_response(ids, mask, prompt_len, cfg.max_length, cfg.min_response_tokens)
    return ids, mask, True


def make_sft_sample(
    row: dict[str, Any], spec: DatasetSpec, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, where: RowRef
) -> Sample:
    """Validate and tokenise one row; raises RowError naming file, row and key for a bad one."""
    if cfg.format == "chat":
        ids, mask, key = _chat_tokens(row, spec, tokenizer, where)
    else:
        ids, mask, key = _plain_tokens(row, spec, cfg, tokenizer, where)
    if cfg.loss == "full":
        mask = [1] * len(ids)
    if not any(mask):
        raise where.error(key, "no tokens to train on (a conversation without an assistant message?)", "no_target")
    ids, mask, truncated = _fit_length(ids, mask, key, cfg, where)
    mask = [0] + mask[1:]  # nothing predicts the first token
    if not any(mask):
        raise where.error(
            key, "no tokens to train on: the only target is the first token, which nothing predicts", "no_target"
        )
    return Sample(input_ids=ids, loss_mask=mask, source=where.source, row=where.row, truncated=truncated)


def load_sft_samples(
    spec: DatasetSpec, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, stats: DataStats
) -> list[Sample]:
    """All valid samples of one dataset, in file order; rows are counted in ``stats``."""
    samples = collect_samples(spec, cfg, lambda row, where: make_sft_sample(row, spec, cfg, tokenizer, where), stats)
    if not samples:
        raise DataError(f"{spec.path}: no usable rows ({stats.rows_read} read; skipped: {dict(stats.skipped) or 0})")
    return samples


def build_sft_datasets(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> SFTData:
    """Read, validate and tokenise every dataset; mix the train sets by weight and set eval aside.

    Eval samples come from ``cfg.eval`` (concatenated, unweighted) or, when that is empty,
    from holding out ``cfg.eval_fraction`` of each train dataset before mixing, so no eval
    sample is ever trained on. See :mod:`raylign.data.mixing` for the mixing semantics.
    """
    train, eval_samples, stats = build_splits(cfg, lambda spec, st: load_sft_samples(spec, cfg, tokenizer, st))
    return SFTData(train=train, eval=eval_samples, stats=stats)
