"""Process-reward data: a prompt, its solution steps and one label per step.

Rows look like ``{"prompt": "...", "steps": ["3+4=7", "7*2=15"], "labels": [true, false]}``
(key names from ``data.input_key`` and the ``prm`` section). A sample's token sequence is
the prompt (a chat user turn with the generation prompt, or ``prompt_template``) followed,
for every step, by the step's tokens and one step-separator token::

    <prompt tokens> <step 1 tokens> <sep> <step 2 tokens> <sep> ...

``loss_mask`` is 1 exactly at the separators and ``step_labels`` holds the label of each, in
order: the model is trained and read at the separator that ends a step. Steps are tokenised
one by one, so inference (:func:`encode_prm_sequence`) builds the very same ids.

Labels: ``hard`` labels are true/false, 1/0 or '+'/'-' (also the minus sign '−') and become
classes 1 (correct) / 0 (incorrect); ``soft`` labels are probabilities in [0, 1] that the step
is correct. Over ``max_length``: ``truncate`` keeps the end of the prompt and the whole steps
that still fit (at least ``min_response_tokens`` tokens of steps when there are that many); a
row where not even the first step fits is dropped and counted under ``no_step_fits``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from raylign.config.data import DataConfig, DatasetSpec
from raylign.config.prm import PRMSection
from raylign.data.collate import collate_packed, collate_padded
from raylign.data.errors import DataError, RowRef
from raylign.data.formatting import truncate_prompt_response
from raylign.data.rows import DataStats, build_splits, check_text, collect_samples, require_list, require_text

POSITIVE_MARKS = ("+",)
NEGATIVE_MARKS = ("-", "\u2212")  # ASCII hyphen-minus and the minus sign


@dataclass
class PRMSample:
    """One tokenised solution: ``loss_mask`` is 1 at step separators, ``step_labels`` one float per step."""

    input_ids: list[int]
    loss_mask: list[int]
    step_labels: list[float]
    source: str
    row: int
    truncated: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_target_tokens(self) -> int:
        return len(self.step_labels)


@dataclass
class PRMData:
    """Train and eval samples, what happened to the rows, and step counts for logging."""

    train: list[PRMSample]
    eval: list[PRMSample]
    stats: DataStats = field(default_factory=DataStats)

    def step_stats(self) -> dict[str, float]:
        labels = [label for sample in self.train for label in sample.step_labels]
        return {"train_steps": len(labels), "train_positive_step_fraction": sum(labels) / max(len(labels), 1)}


# ---- the step separator ---------------------------------------------------------------------


def single_token_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    """The id of ``text`` when the tokenizer encodes it as exactly one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def add_step_separator(tokenizer: PreTrainedTokenizerBase, separator: str) -> int:
    """The separator's token id, adding ``separator`` to the tokenizer as a special token when it is not
    one token already. The caller resizes the model's embeddings to ``len(tokenizer)``."""
    token_id = single_token_id(tokenizer, separator)
    if token_id is not None:
        return token_id
    tokenizer.add_tokens([separator], special_tokens=True)
    token_id = single_token_id(tokenizer, separator)
    if token_id is None:
        raise ValueError(f"the step separator {separator!r} is still not a single token after adding it")
    return token_id


# ---- token layout (shared with inference) ---------------------------------------------------


def encode_prm_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, prompt_format: str, prompt_template: str = "{input}\n"
) -> list[int]:
    """Prompt ids: a chat user turn plus the assistant generation prompt, or ``prompt_template`` (plain)."""
    if prompt_format == "chat":
        if not tokenizer.chat_template:
            raise DataError("the tokenizer has no chat template; set data.format to 'plain'")
        messages = [{"role": "user", "content": prompt}]
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
        return list(encoded["input_ids"])
    if prompt_format == "plain":
        return list(tokenizer(prompt_template.format(input=prompt), add_special_tokens=True)["input_ids"])
    raise ValueError(f"prompt format must be 'chat' or 'plain', got {prompt_format!r}")


def encode_prm_sequence(
    tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], steps: list[str], separator_id: int
) -> tuple[list[int], list[int]]:
    """``prompt_ids + (step tokens + separator) per step`` and the positions of the separators."""
    ids = list(prompt_ids)
    positions = []
    for step in steps:
        ids.extend(tokenizer.encode(step, add_special_tokens=False))
        positions.append(len(ids))
        ids.append(separator_id)
    return ids, positions


# ---- row validation -------------------------------------------------------------------------


def _hard_label(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return float(value)
    if isinstance(value, str) and value.strip() in POSITIVE_MARKS + NEGATIVE_MARKS:
        return 1.0 if value.strip() in POSITIVE_MARKS else 0.0
    return None


def _soft_label(value: Any) -> float | None:
    if isinstance(value, (bool, str)):
        return _hard_label(value)
    # The comparisons also refuse NaN and infinities, and need no float() of a huge integer.
    if isinstance(value, (int, float)) and 0 <= value <= 1:
        return float(value)
    return None


def parse_step_label(value: Any, label_type: str, key: str, where: RowRef) -> float:
    """A label as the probability that the step is correct (0.0 or 1.0 for hard labels)."""
    label = _hard_label(value) if label_type == "hard" else _soft_label(value)
    if label is None:
        allowed = (
            "true/false, 1/0 or '+'/'-'" if label_type == "hard" else "a probability in [0, 1], true/false or '+'/'-'"
        )
        raise where.error(key, f"bad {label_type} step label {value!r:.40}; expected {allowed}", "bad_label")
    return label


def _row_steps(row: dict[str, Any], prm: PRMSection, where: RowRef) -> list[str]:
    steps = require_list(row, prm.steps_key, where)
    for i, step in enumerate(steps):
        key = f"{prm.steps_key}[{i}]"
        check_text(step, key, where)
        if prm.step_separator in step:
            raise where.error(key, f"the step contains the step separator {prm.step_separator!r}", "separator_in_step")
    return steps


def _row_labels(row: dict[str, Any], prm: PRMSection, num_steps: int, where: RowRef) -> list[float]:
    labels = require_list(row, prm.labels_key, where)
    if len(labels) != num_steps:
        raise where.error(
            prm.labels_key,
            f"{len(labels)} labels for {num_steps} steps in '{prm.steps_key}' (one label per step)",
            "label_count",
        )
    return [parse_step_label(v, prm.label_type, f"{prm.labels_key}[{i}]", where) for i, v in enumerate(labels)]


def _fit_length(
    ids: list[int], positions: list[int], prompt_len: int, cfg: DataConfig, steps_key: str, where: RowRef
) -> tuple[list[int], list[int], bool]:
    """Apply the truncation policy; returns ids, the separator positions kept and whether it cut."""
    if len(ids) <= cfg.max_length:
        return ids, positions, False
    problem = f"{len(ids)} tokens, over data.max_length={cfg.max_length}"
    if cfg.truncation == "error":
        raise where.error(steps_key, f"{problem} (data.truncation='error'; use 'truncate' or 'drop')", "too_long")
    if cfg.truncation == "drop":
        raise where.dropped(steps_key, f"{problem}; dropped (data.truncation='drop')", "too_long")
    # Slice the original position numbers along with the ids to see which separators survive.
    kept_ids, kept_from = truncate_prompt_response(
        ids, list(range(len(ids))), prompt_len, cfg.max_length, cfg.min_response_tokens
    )
    separators = set(positions)
    new_positions = [i for i, original in enumerate(kept_from) if original in separators]
    if not new_positions:
        # Nothing left to label: the row is left out and counted, as truncation='drop' would.
        raise where.dropped(
            steps_key, f"{problem}, and no whole step fits after the prompt; dropped (no labelled step)", "no_step_fits"
        )
    return kept_ids[: new_positions[-1] + 1], new_positions, True


def make_prm_sample(
    row: dict[str, Any],
    spec: DatasetSpec,
    cfg: DataConfig,
    prm: PRMSection,
    tokenizer: PreTrainedTokenizerBase,
    separator_id: int,
    where: RowRef,
) -> PRMSample:
    """Validate and tokenise one row; raises RowError naming file, row and key for a bad one."""
    prompt = require_text(row, spec.input_key, where)
    steps = _row_steps(row, prm, where)
    labels = _row_labels(row, prm, len(steps), where)
    prompt_ids = encode_prm_prompt(tokenizer, prompt, cfg.format, cfg.prompt_template)
    ids, positions = encode_prm_sequence(tokenizer, prompt_ids, steps, separator_id)
    ids, kept_positions, truncated = _fit_length(ids, positions, len(prompt_ids), cfg, prm.steps_key, where)
    # Truncation cuts the prompt from the left and steps from the right: the first steps survive.
    labels = labels[: len(kept_positions)]
    mask = [0] * len(ids)
    for position in kept_positions:
        mask[position] = 1
    return PRMSample(ids, mask, labels, where.source, where.row, truncated)


# ---- datasets -------------------------------------------------------------------------------


def load_prm_samples(
    spec: DatasetSpec,
    cfg: DataConfig,
    prm: PRMSection,
    tokenizer: PreTrainedTokenizerBase,
    separator_id: int,
    stats: DataStats,
) -> list[PRMSample]:
    """All valid samples of one dataset, in file order; rows are counted in ``stats``."""
    samples = collect_samples(
        spec, cfg, lambda row, where: make_prm_sample(row, spec, cfg, prm, tokenizer, separator_id, where), stats
    )
    if not samples:
        raise DataError(f"{spec.path}: no usable rows ({stats.rows_read} read; skipped: {dict(stats.skipped) or 0})")
    return samples


def build_prm_datasets(
    cfg: DataConfig, prm: PRMSection, tokenizer: PreTrainedTokenizerBase, separator_id: int
) -> PRMData:
    """Read and tokenise every dataset; hold out ``eval_fraction`` or read ``cfg.eval``; mix train by weight."""
    train, eval_samples, stats = build_splits(
        cfg, lambda spec, st: load_prm_samples(spec, cfg, prm, tokenizer, separator_id, st)
    )
    return PRMData(train=train, eval=eval_samples, stats=stats)


# ---- batching -------------------------------------------------------------------------------


def _labels_at_positions(sample: PRMSample) -> list[float]:
    values = [0.0] * len(sample.input_ids)
    positions = [t for t, flag in enumerate(sample.loss_mask) if flag]
    for position, label in zip(positions, sample.step_labels, strict=True):
        values[position] = label
    return values


def collate_prm(
    samples: list[PRMSample], pad_token_id: int, packing: bool, soft_labels: bool, row_tokens: int = 0
) -> dict[str, torch.Tensor]:
    """The token batch of :func:`collate_padded` / :func:`collate_packed` (``loss_mask`` = step separators)
    plus ``step_labels`` in the same layout: class ids (long) for hard labels, probabilities (float) for soft."""
    batch = collate_packed(samples, pad_token_id, row_tokens) if packing else collate_padded(samples, pad_token_id)
    labels = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    flat_labels = labels.view(-1)
    row_length = labels.shape[1]
    for i, sample in enumerate(samples):
        start = int(batch["seq_starts"][i]) if packing else i * row_length
        flat_labels[start : start + len(sample.input_ids)] = torch.tensor(_labels_at_positions(sample))
    batch["step_labels"] = labels if soft_labels else labels.round().long()
    return batch
