"""Unpaired preference data for KTO: a prompt, one completion and whether it is desirable.

Rows look like ``{"prompt": "...", "completion": "...", "label": true}`` (keys from
``data.input_key``, ``data.output_key`` and ``data.label_key``; an optional system prompt under
``data.system_key``). The label must be a boolean: true = desirable, false = undesirable.
Prompt and completion are tokenised exactly as an SFT row (:func:`make_sft_sample`), so the
completion tokens (``loss_mask == 1``) are the ones scored.

KTO's reference point needs completions scored under *other* prompts: :func:`mismatched_samples`
pairs each sample's prompt with the completion of the previous sample in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from raylign.config.data import DataConfig, DatasetSpec
from raylign.data.collate import collate_packed, collate_padded
from raylign.data.errors import DataError, RowRef
from raylign.data.rows import (
    DataStats,
    build_splits,
    collect_samples,
    optional_text,
    read_from_csv,
    require_key,
    require_text,
)
from raylign.data.sft import Sample, make_sft_sample


@dataclass
class KTOSample:
    """One tokenised prompt + completion; ``loss_mask`` marks the completion tokens."""

    input_ids: list[int]
    loss_mask: list[int]
    desirable: bool
    source: str
    row: int
    truncated: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_target_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def completion_start(self) -> int:
        """Index of the first completion token: everything before it is the prompt."""
        return self.loss_mask.index(1)


@dataclass
class KTOData:
    """Train and eval samples, and what happened to the rows of every file read."""

    train: list[KTOSample]
    eval: list[KTOSample]
    stats: DataStats = field(default_factory=DataStats)

    def label_stats(self) -> dict[str, int]:
        desirable = sum(s.desirable for s in self.train)
        return {"train_desirable": desirable, "train_undesirable": len(self.train) - desirable}


def require_bool(row: dict[str, Any], key: str, where: RowRef) -> bool:
    """The boolean under ``key`` (JSON true/false); anything else, 0/1 and 'true' included, is an error,
    except in a CSV file, whose cells are all text: there the cell reads true or false (any case)."""
    value = require_key(row, key, where)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if read_from_csv(where) and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise where.error(
        key,
        f"expected a boolean (true = desirable, false = undesirable), got {type(value).__name__}: {value!r:.40}",
        "wrong_type",
    )


def make_kto_sample(
    row: dict[str, Any], spec: DatasetSpec, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, where: RowRef
) -> KTOSample:
    """Validate and tokenise one row; raises RowError naming file, row and key for a bad one."""
    prompt = require_text(row, spec.input_key, where)
    completion = require_text(row, spec.output_key, where)
    desirable = require_bool(row, spec.label_key, where)
    system = optional_text(row, spec.system_key, where)
    # Only the prompt/completion keys go on, so a stray messages key cannot change what is scored.
    sft_row = {spec.input_key: prompt, spec.output_key: completion, spec.system_key: system}
    sample = make_sft_sample(sft_row, spec, cfg, tokenizer, where)
    return KTOSample(sample.input_ids, sample.loss_mask, desirable, where.source, where.row, sample.truncated)


def load_kto_samples(
    spec: DatasetSpec, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, stats: DataStats
) -> list[KTOSample]:
    """All valid samples of one dataset, in file order; rows are counted in ``stats``."""
    samples = collect_samples(spec, cfg, lambda row, where: make_kto_sample(row, spec, cfg, tokenizer, where), stats)
    if not samples:
        raise DataError(f"{spec.path}: no usable rows ({stats.rows_read} read; skipped: {dict(stats.skipped) or 0})")
    return samples


def build_kto_datasets(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> KTOData:
    """Read and tokenise every dataset; hold out ``eval_fraction`` or read ``cfg.eval``; mix train by weight."""
    train, eval_samples, stats = build_splits(cfg, lambda spec, st: load_kto_samples(spec, cfg, tokenizer, st))
    return KTOData(train=train, eval=eval_samples, stats=stats)


def mismatched_samples(samples: list[KTOSample], max_length: int) -> list[Sample]:
    """Sample ``i``'s prompt followed by sample ``i - 1``'s completion (cyclically), cut to ``max_length``.

    These pairs estimate KTO's reference point ``KL(pi || pi_ref)`` on completions that do not
    answer their prompt (Ethayarajh et al. 2024, section 4.1). With one sample the "pair" is
    the sample itself.
    """
    pairs = []
    for i, sample in enumerate(samples):
        other = samples[i - 1]
        prompt = sample.input_ids[: sample.completion_start]
        ids = prompt + other.input_ids[other.completion_start :]
        mask = [0] * len(prompt) + other.loss_mask[other.completion_start :]
        truncated = len(ids) > max_length
        pairs.append(Sample(ids[:max_length], mask[:max_length], sample.source, sample.row, truncated))
    return pairs


def _collate_tokens(samples: list, pad_token_id: int, packing: bool, row_tokens: int) -> dict[str, torch.Tensor]:
    return collate_packed(samples, pad_token_id, row_tokens) if packing else collate_padded(samples, pad_token_id)


def collate_kto(
    samples: list[KTOSample],
    pad_token_id: int,
    packing: bool,
    with_kl_pairs: bool,
    max_length: int,
    row_tokens: int = 0,
) -> dict[str, torch.Tensor]:
    """Token batch of the samples, ``desirable`` ``[B]`` (bool), and with ``with_kl_pairs`` the batch of
    :func:`mismatched_samples` under the same keys prefixed ``kl_``."""
    batch = _collate_tokens(samples, pad_token_id, packing, row_tokens)
    batch["desirable"] = torch.tensor([s.desirable for s in samples], dtype=torch.bool)
    if with_kl_pairs:
        pairs = _collate_tokens(mismatched_samples(samples, max_length), pad_token_id, packing, row_tokens)
        batch.update({f"kl_{key}": value for key, value in pairs.items()})
    return batch
