"""Preference pairs: a prompt with a chosen and a rejected response, tokenised around one shared prompt.

Row shapes (key names come from the :class:`DatasetSpec`):

- ``{prompt, chosen, rejected}`` with texts. Chat format renders the prompt as a user message
  (after an optional system message) and each response as the assistant reply; plain format is
  ``prompt_template.format(input=prompt) + response (+ eos)``.
- Chat format only: ``prompt`` may be a conversation (a list of {role, content} ending before the
  reply), and ``chosen`` / ``rejected`` may be lists of assistant messages, or whole
  conversations (prompt turns included). Whole conversations need no ``prompt`` key: each is
  split before its trailing assistant messages, and the two prompts must be equal.

Both sides share the prompt's tokens: a :class:`PairSample` holds them once, and each side's
response tokens with a mask of the tokens that count for log-probabilities (the assistant
text and its end-of-turn token; tokens a chat template adds after that, such as ChatML's
newline, are kept in the sequence but masked). A reward model reads the whole sequence and
scores its last token, as the RL reward source renders it.

A pair whose responses tokenise identically, a missing key, or an empty text is a
:class:`RowError` naming the file, row and key (skipped and counted with ``data.skip_bad_rows``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from raylign.config.data import DataConfig, DatasetSpec
from raylign.data.chat import Message, tokenize_conversation, validate_messages
from raylign.data.collate import collate_packed, collate_padded
from raylign.data.errors import DataError, RowRef
from raylign.data.formatting import encode_plain
from raylign.data.rows import (
    DataStats,
    build_splits,
    check_text,
    collect_samples,
    optional_text,
    read_from_csv,
    refuse_system_beside_conversation,
    require_key,
)

REPLY_ROLES = ("assistant", "tool")


@dataclass
class PairSample:
    """One tokenised preference pair; the sides are ``prompt_ids + chosen_ids`` and ``prompt_ids + rejected_ids``.

    ``*_mask[t] == 1`` marks the response tokens whose log-probabilities count. ``margin`` is
    the row's preference margin when one was asked for.
    """

    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    source: str
    row: int
    margin: float | None = None
    truncated: bool = False

    @property
    def num_tokens(self) -> int:
        return 2 * len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)

    @property
    def num_target_tokens(self) -> int:
        return sum(self.chosen_mask) + sum(self.rejected_mask)


@dataclass
class PairData:
    """Train and eval pairs, and what happened to the rows of every file read."""

    train: list[PairSample]
    eval: list[PairSample]
    stats: DataStats = field(default_factory=DataStats)


@dataclass
class Side:
    """One response's tokens after the prompt, and which of them are scored."""

    ids: list[int]
    mask: list[int]


# ---- reading a row ---------------------------------------------------------------------


def _plain_text(row: dict[str, Any], key: str, where: RowRef) -> str:
    value = require_key(row, key, where)
    if isinstance(value, list):
        raise where.error(key, "a conversation (list of messages) needs data.format 'chat'", "wrong_type")
    return check_text(value, key, where)


def _prompt_messages(row: dict[str, Any], spec: DatasetSpec, where: RowRef) -> list[Message]:
    value = require_key(row, spec.input_key, where)
    if isinstance(value, list):
        refuse_system_beside_conversation(row, spec.system_key, spec.input_key, where)
        messages = validate_messages(value, spec.input_key, where)
        if messages[-1]["role"] in REPLY_ROLES:
            raise where.error(
                spec.input_key,
                f"a prompt conversation must end before the reply (last role is {messages[-1]['role']!r})",
                "bad_role",
            )
        return messages
    text = check_text(value, spec.input_key, where)
    system = optional_text(row, spec.system_key, where)
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]


def _split_reply(messages: list[Message]) -> tuple[list[Message], list[Message]]:
    """(prompt turns, trailing assistant/tool turns) of a conversation."""
    cut = len(messages)
    while cut > 0 and messages[cut - 1]["role"] in REPLY_ROLES:
        cut -= 1
    return messages[:cut], messages[cut:]


def _response_messages(row: dict[str, Any], key: str, where: RowRef) -> tuple[list[Message] | None, list[Message]]:
    """(prompt turns when ``row[key]`` is a whole conversation else None, the reply turns)."""
    value = require_key(row, key, where)
    if not isinstance(value, list):
        return None, [{"role": "assistant", "content": check_text(value, key, where)}]
    prompt, reply = _split_reply(validate_messages(value, key, where))
    if not reply:
        raise where.error(key, "the conversation has no assistant reply at its end", "no_target")
    if reply[0]["role"] != "assistant":
        raise where.error(
            key,
            f"the reply starts with a {reply[0]['role']!r} message; a reply starts with an assistant message",
            "bad_role",
        )
    return (prompt or None), reply


def _chat_pair_messages(
    row: dict[str, Any], spec: DatasetSpec, where: RowRef
) -> tuple[list[Message], list[Message], list[Message]]:
    """(prompt, chosen reply, rejected reply) messages of a chat row."""
    chosen_prompt, chosen = _response_messages(row, spec.chosen_key, where)
    rejected_prompt, rejected = _response_messages(row, spec.rejected_key, where)
    if chosen_prompt is None and rejected_prompt is None:
        return _prompt_messages(row, spec, where), chosen, rejected
    if chosen_prompt is None or rejected_prompt is None:
        whole, reply = (
            (spec.chosen_key, spec.rejected_key) if rejected_prompt is None else (spec.rejected_key, spec.chosen_key)
        )
        raise where.error(
            reply,
            f"'{whole}' is a whole conversation but '{reply}' is only a reply; give both as "
            "conversations or both as replies to the prompt",
            "different_prompts",
        )
    if chosen_prompt != rejected_prompt:
        raise where.error(
            spec.rejected_key,
            f"the '{spec.chosen_key}' and '{spec.rejected_key}' conversations have "
            "different prompts (everything before the final assistant reply must be equal)",
            "different_prompts",
        )
    _check_prompt_beside_conversations(row, spec, chosen_prompt, where)
    return chosen_prompt, chosen, rejected


def _check_prompt_beside_conversations(
    row: dict[str, Any], spec: DatasetSpec, conversation_prompt: list[Message], where: RowRef
) -> None:
    """Whole conversations carry their own prompt, which is what is trained on. A prompt key beside them
    (as some datasets keep, e.g. ultrafeedback_binarized) must say the same: its text the last user
    turn, or its messages the turns; a system prompt key would be dropped."""
    refuse_system_beside_conversation(row, spec.system_key, spec.chosen_key, where)
    given = row.get(spec.input_key)
    if given is None:
        return
    users = [m["content"] for m in conversation_prompt if m["role"] == "user"]
    if isinstance(given, list):
        agrees = validate_messages(given, spec.input_key, where) == conversation_prompt
    else:
        agrees = bool(users) and check_text(given, spec.input_key, where).strip() == users[-1].strip()
    if not agrees:
        raise where.error(
            spec.input_key,
            f"differs from the prompt of the whole conversations in '{spec.chosen_key}'/'{spec.rejected_key}', "
            "which is what would be trained on: remove it, or give the replies only",
            "different_prompts",
        )


# ---- tokenising ------------------------------------------------------------------------


def _render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[Message], key: str, where: RowRef) -> list[int]:
    if not tokenizer.chat_template:
        raise DataError(f"{where.source}: the tokenizer has no chat template; set data.format to 'plain'")
    try:
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    except TemplateError as err:
        raise where.error(key, f"the chat template rejected this conversation: {err}", "template_error") from None
    return list(encoded["input_ids"])


def _chat_side(
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[Message],
    prompt_ids: list[int],
    reply: list[Message],
    key: str,
    where: RowRef,
) -> Side:
    ids, mask = tokenize_conversation(tokenizer, prompt + reply, key, where)
    if ids[: len(prompt_ids)] != prompt_ids:
        # A row error: one row's text can cause it (see tokenize_conversation), so skip_bad_rows can skip it.
        raise where.error(
            key,
            "the tokenizer's chat template renders the prompt with a generation prompt differently from the start "
            "of the whole conversation (a reply whose first characters merge into one token with the end of the "
            "assistant header?), so the reply cannot be located; use data.format 'plain'",
            "template_mismatch",
        )
    return Side(ids[len(prompt_ids) :], mask[len(prompt_ids) :])


def _chat_pair(
    row: dict[str, Any], spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase, where: RowRef
) -> tuple[list[int], Side, Side]:
    prompt, chosen, rejected = _chat_pair_messages(row, spec, where)
    prompt_ids = _render_prompt(tokenizer, prompt, spec.input_key, where)
    return (
        prompt_ids,
        _chat_side(tokenizer, prompt, prompt_ids, chosen, spec.chosen_key, where),
        _chat_side(tokenizer, prompt, prompt_ids, rejected, spec.rejected_key, where),
    )


def _plain_pair(
    row: dict[str, Any], spec: DatasetSpec, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, where: RowRef
) -> tuple[list[int], Side, Side]:
    prompt_text = cfg.prompt_template.format(input=_plain_text(row, spec.input_key, where))
    sides = []
    for key in (spec.chosen_key, spec.rejected_key):
        ids, prompt_len = encode_plain(tokenizer, prompt_text, _plain_text(row, key, where), cfg.add_eos)
        sides.append(Side(ids[prompt_len:], [1] * (len(ids) - prompt_len)))
    prompt_ids, _ = encode_plain(tokenizer, prompt_text, None, add_eos=False)
    return prompt_ids, sides[0], sides[1]


def _read_margin(row: dict[str, Any], key: str, where: RowRef) -> float:
    value = require_key(row, key, where)
    if read_from_csv(where) and isinstance(value, str):  # CSV cells are all text
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond the float range
            number = math.inf
        if math.isfinite(number):
            return number
    raise where.error(key, f"expected a finite number (the pair's margin), got {value!r:.80}", "wrong_type")


# ---- length policy ---------------------------------------------------------------------


def truncate_pair(
    prompt_ids: list[int], chosen: Side, rejected: Side, max_length: int, min_response_tokens: int
) -> tuple[list[int], Side, Side]:
    """Cut both sides to ``max_length`` keeping the prompt's end (the same for both) and each response's start.

    The prompt keeps at most ``max_length - min(longest response, min_response_tokens)`` of its
    last tokens; each response then keeps as many of its first tokens as fit.
    """
    longest = max(len(chosen.ids), len(rejected.ids))
    keep_prompt = min(len(prompt_ids), max_length - min(longest, min_response_tokens))
    room = max_length - keep_prompt
    cut = [Side(side.ids[:room], side.mask[:room]) for side in (chosen, rejected)]
    return prompt_ids[len(prompt_ids) - keep_prompt :], cut[0], cut[1]


def _fit_length(
    prompt_ids: list[int], chosen: Side, rejected: Side, spec: DatasetSpec, cfg: DataConfig, where: RowRef
) -> tuple[list[int], Side, Side, bool]:
    longest = len(prompt_ids) + max(len(chosen.ids), len(rejected.ids))
    if longest <= cfg.max_length:
        return prompt_ids, chosen, rejected, False
    key = spec.chosen_key if len(chosen.ids) >= len(rejected.ids) else spec.rejected_key
    problem = f"{longest} tokens (prompt and response), over data.max_length={cfg.max_length}"
    if cfg.truncation == "error":
        raise where.error(key, f"{problem} (data.truncation='error'; use 'truncate' or 'drop')", "too_long")
    if cfg.truncation == "drop":
        raise where.dropped(key, f"{problem}; dropped (data.truncation='drop')", "too_long")
    return (*truncate_pair(prompt_ids, chosen, rejected, cfg.max_length, cfg.min_response_tokens), True)


def _check_sides(chosen: Side, rejected: Side, spec: DatasetSpec, where: RowRef, after_truncation: bool) -> None:
    for key, side in ((spec.chosen_key, chosen), (spec.rejected_key, rejected)):
        if not any(side.mask):
            raise where.error(key, "no response tokens left to score", "no_target")
    if chosen.ids == rejected.ids:
        when = " after truncation to data.max_length" if after_truncation else ""
        raise where.error(
            spec.rejected_key,
            f"'{spec.chosen_key}' and '{spec.rejected_key}' are identical{when}; "
            "a preference pair needs two different responses",
            "identical_pair",
        )


def make_pair_sample(
    row: dict[str, Any],
    spec: DatasetSpec,
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    where: RowRef,
    margin_key: str | None = None,
) -> PairSample:
    """Validate and tokenise one pair row; raises RowError naming file, row and key for a bad one."""
    if cfg.format == "chat":
        prompt_ids, chosen, rejected = _chat_pair(row, spec, tokenizer, where)
    else:
        prompt_ids, chosen, rejected = _plain_pair(row, spec, cfg, tokenizer, where)
    margin = _read_margin(row, margin_key, where) if margin_key is not None else None
    _check_sides(chosen, rejected, spec, where, after_truncation=False)
    prompt_ids, chosen, rejected, truncated = _fit_length(prompt_ids, chosen, rejected, spec, cfg, where)
    if truncated:
        _check_sides(chosen, rejected, spec, where, after_truncation=True)
    return PairSample(
        prompt_ids,
        chosen.ids,
        chosen.mask,
        rejected.ids,
        rejected.mask,
        where.source,
        where.row,
        margin=margin,
        truncated=truncated,
    )


# ---- datasets --------------------------------------------------------------------------


def load_pair_samples(
    spec: DatasetSpec,
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    stats: DataStats,
    margin_key: str | None = None,
) -> list[PairSample]:
    """All valid pairs of one dataset, in file order; rows are counted in ``stats``."""
    samples = collect_samples(
        spec, cfg, lambda row, where: make_pair_sample(row, spec, cfg, tokenizer, where, margin_key), stats
    )
    if not samples:
        raise DataError(f"{spec.path}: no usable rows ({stats.rows_read} read; skipped: {dict(stats.skipped) or 0})")
    return samples


def build_pair_datasets(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, margin_key: str | None = None) -> PairData:
    """Read, validate and tokenise every pair dataset; mix the train sets by weight and set eval aside.

    Eval pairs come from ``cfg.eval`` or, when that is empty, from holding out
    ``cfg.eval_fraction`` of each train dataset before mixing (as for SFT data). With
    ``margin_key`` every row must hold a number under that key.
    """
    train, eval_samples, stats = build_splits(
        cfg, lambda spec, st: load_pair_samples(spec, cfg, tokenizer, st, margin_key)
    )
    return PairData(train=train, eval=eval_samples, stats=stats)


# ---- batching --------------------------------------------------------------------------


@dataclass
class _Sequence:
    input_ids: list[int]
    loss_mask: list[int]


def pair_sequences(samples: Sequence[PairSample]) -> list[_Sequence]:
    """The ``2B`` sequences of ``B`` pairs: every chosen side first, then every rejected side, in order."""
    chosen = [_Sequence(s.prompt_ids + s.chosen_ids, [0] * len(s.prompt_ids) + s.chosen_mask) for s in samples]
    rejected = [_Sequence(s.prompt_ids + s.rejected_ids, [0] * len(s.prompt_ids) + s.rejected_mask) for s in samples]
    return chosen + rejected


def collate_pairs(
    samples: Sequence[PairSample], pad_token_id: int, packed: bool, row_tokens: int = 0
) -> dict[str, torch.Tensor]:
    """One batch of ``2B`` sequences: sequences ``0..B-1`` are the chosen sides, ``B..2B-1`` the rejected ones.

    Padded (``[2B, T]`` with ``attention_mask``) or packed (``[rows, L]`` with ``seq_starts`` and
    ``seq_lens`` ``[2B]``), as :func:`collate_padded` / :func:`collate_packed`. Adds ``response_lengths``
    ``[2B]`` (scored tokens of each sequence) and, when every pair has one, ``margin`` ``[B]``.
    """
    sequences = pair_sequences(samples)
    batch = collate_packed(sequences, pad_token_id, row_tokens) if packed else collate_padded(sequences, pad_token_id)
    batch["response_lengths"] = torch.tensor([sum(s.loss_mask) for s in sequences], dtype=torch.long)
    margins = [s.margin for s in samples]
    if all(m is not None for m in margins):
        batch["margin"] = torch.tensor(margins, dtype=torch.float32)
    return batch


def num_pairs(batch: dict[str, Any]) -> int:
    """How many pairs a :func:`collate_pairs` batch holds."""
    return int(batch["response_lengths"].shape[0]) // 2
