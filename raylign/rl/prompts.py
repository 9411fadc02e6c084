"""Prompt datasets for RL: each row becomes token ids for the engines plus what the rewards need."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raylign.config.data import DatasetSpec
from raylign.config.rl import RLDataConfig
from raylign.data import (
    RowRef,
    check_text,
    optional_text,
    read_rows,
    refuse_system_beside_conversation,
    require_key,
    validate_messages,
)
from raylign.data.mixing import mix_datasets
from raylign.rollout.rewards.base import REWARD_ARGUMENTS


@dataclass
class Prompt:
    text: str  # what reward functions see as the prompt (the rendered prompt for chat rows)
    token_ids: list[int]
    label: Any  # the reference answer, given to reward sources
    source: str  # data source name, for per-source evaluation
    where: RowRef
    raw: Any = None  # the row's input as it is (a string or messages): what an agent environment's reset() gets
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's other fields


def _render(
    row: dict[str, Any], spec: DatasetSpec, cfg: RLDataConfig, tokenizer, where: RowRef
) -> tuple[str, list[int]]:
    value = require_key(row, spec.input_key, where)
    if cfg.format == "plain":
        text = cfg.prompt_template.format(input=check_text(value, spec.input_key, where))
        # With the tokenizer's own special tokens (a BOS where it adds one), as the offline trainers'
        # plain prompts (raylign.data.formatting.encode_plain): a model tuned there is sampled as trained.
        return text, tokenizer(text, add_special_tokens=True)["input_ids"]
    if isinstance(value, list):
        refuse_system_beside_conversation(row, spec.system_key, spec.input_key, where)
        messages = validate_messages(value, spec.input_key, where)
        if messages[-1]["role"] == "assistant":  # the model would answer with a second assistant turn
            raise where.error(
                spec.input_key, "a prompt conversation must end before the reply (last role is 'assistant')", "bad_role"
            )
    else:  # a text prompt: the user's turn, after the row's system prompt where it has one (as in SFT)
        system = optional_text(row, spec.system_key, where)
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": check_text(value, spec.input_key, where)})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def load_train_prompts(cfg: RLDataConfig, tokenizer) -> list[Prompt]:
    """The training prompts: every row of every ``data.train`` file, or with weights on the files one
    epoch of their weighted mixture, as the offline trainers mix (:mod:`raylign.data.mixing`)."""
    per_file = [load_prompts([spec], cfg, tokenizer) for spec in cfg.train]
    if cfg.train[0].weight is None:
        return [prompt for prompts in per_file for prompt in prompts]
    mixture = mix_datasets([len(p) for p in per_file], [spec.weight or 0.0 for spec in cfg.train], seed=cfg.seed)
    return [per_file[dataset][index] for dataset, index in mixture]


def load_prompts(specs: list[DatasetSpec], cfg: RLDataConfig, tokenizer) -> list[Prompt]:
    """Read every prompt row; a bad row is an error naming its file, row and key."""
    prompts: list[Prompt] = []
    for spec in specs:
        count = 0
        for row_number, row in read_rows(spec.path, split=spec.split):
            where = RowRef(spec.path, row_number)
            text, ids = _render(row, spec, cfg, tokenizer, where)
            if len(ids) > cfg.max_prompt_length:
                raise where.error(
                    spec.input_key,
                    f"prompt has {len(ids)} tokens, more than data.max_prompt_length ({cfg.max_prompt_length})",
                    "too_long",
                )
            source = data_source(row, cfg.source_key, spec.path)
            raw = row.get(spec.input_key)
            metadata = {k: v for k, v in row.items() if k not in (spec.input_key, spec.label_key)}
            for key in set(REWARD_ARGUMENTS).intersection(metadata):
                raise where.error(
                    key,
                    "the row's other fields reach reward functions as keyword arguments, and this name is one of "
                    f"their own ({', '.join(sorted(REWARD_ARGUMENTS))}): rename the field",
                    "reserved_name",
                )
            prompts.append(Prompt(text, ids, row.get(spec.label_key), source, where, raw, metadata))
            count += 1
            if spec.max_samples is not None and count >= spec.max_samples:
                break
        if count == 0:
            raise ValueError(f"{spec.path}: no prompt rows")
    return prompts


def data_source(row: dict[str, Any], source_key: str, path: str) -> str:
    """The data source a row of the file ``path`` belongs to: its ``source_key`` field, else the file's name
    without its suffix. Reward sources get it as the ``source`` metadata (a row's own ``source`` field wins)."""
    return str(row.get(source_key) or Path(path).stem)
