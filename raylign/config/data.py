"""Data section: which files to read, how rows become token sequences, and how they are batched.

Truncation policies (``truncation``), for a row longer than ``max_length`` tokens:

- ``error``: stop with an error naming the file and row.
- ``truncate``: keep the end of the prompt and the start of the response. The prompt is cut
  from the left to at most ``max_length - min_response_tokens`` tokens (fewer when the
  response is shorter than that), then the response is cut from the right to fill what is
  left. A cut response loses its end-of-sequence token. With ``loss='full'`` every token is a
  target, so the row is simply cut from the right (a document keeps its start).
- ``drop``: skip the row and count it under ``too_long`` in the data statistics.
"""

from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raylign.config.base import Section


def check_prompt_template(value: str) -> str:
    """A plain-format prompt template must be a format string with exactly the field ``{input}``."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
    except ValueError as err:
        raise ValueError(f"not a valid format string ({err}); write {{{{ and }}}} for literal braces") from None
    if fields != {"input"}:
        raise ValueError(f"must contain the field {{input}} and no other fields; found {sorted(fields)}")
    return value


def dataset_list(value: Any) -> Any:
    """A dataset list setting given one dataset (``--data.train file.jsonl`` on the command line gives one
    path, not a list) as a list of it."""
    return [value] if isinstance(value, (str, dict)) else value


# The keys of a dataset's responses, pairs and conversations: a prompt dataset reads none of them.
RESPONSE_KEYS = ("output_key", "messages_key", "chosen_key", "rejected_key")


def refuse_plain_settings_under_chat(section: Any, fields: list[str]) -> None:
    """Plain-format settings (``prompt_template``, ``add_eos``) given a value under ``format: chat``, where
    the tokenizer's chat template writes the prompt and would leave them unread: refused naming them."""
    if section.format != "chat":
        return
    given = section.set_away_from_default(fields)
    if given:
        values = ", ".join(f"data.{f} {getattr(section, f)!r}" for f in given)
        raise ValueError(
            f"{values}: read by data.format plain only; under data.format chat (the default) the tokenizer's chat "
            "template writes the prompt: set data.format plain, or leave them unset"
        )


def refuse_keys_prompts_ignore(specs: list[DatasetSpec], keys: tuple[str, ...], field: str, reads: str) -> None:
    """Refuse a prompt dataset that sets one of ``keys`` (it would be accepted and ignored), naming it."""
    for i, spec in enumerate(specs):
        unused = spec.set_away_from_default(keys)
        if unused:
            raise ValueError(
                f"{field}.{i}: {', '.join(unused)} {'is' if len(unused) == 1 else 'are'} for training data; {reads}"
            )


class DatasetSpec(Section):
    """One dataset file or folder, with the names of the keys its rows use."""

    path: str = Field(
        ...,
        description="A .jsonl, .json (a list of objects), .parquet, .csv, .arrow or .feather file, or a folder "
        "saved with datasets.save_to_disk.",
    )
    weight: float | None = Field(
        None,
        gt=0,
        description="Mixing weight: this dataset's share of an epoch is weight / sum of the train weights "
        "(upsampled or subsampled to that share). Set it on every train dataset or on none (then each "
        "contributes all its rows once). Not used for eval sets.",
    )
    split: str | None = Field(
        None, description="Split to read from a datasets folder holding several splits (e.g. 'train')."
    )
    input_key: str = Field("prompt", min_length=1, description="Key of the prompt text.")
    output_key: str = Field("completion", min_length=1, description="Key of the response text.")
    messages_key: str = Field(
        "messages",
        min_length=1,
        description="Key of a chat conversation (a list of {role, content}); used instead of input/output "
        "when a row has it (chat format only).",
    )
    system_key: str = Field(
        "system",
        min_length=1,
        description="Key of an optional system prompt for input/output rows in chat format; rows without it "
        "get no system message.",
    )
    chosen_key: str = Field("chosen", min_length=1, description="Key of the preferred response (preference pairs).")
    rejected_key: str = Field(
        "rejected", min_length=1, description="Key of the dispreferred response (preference pairs)."
    )
    label_key: str = Field("label", min_length=1, description="Key of a row's label (e.g. desirable/undesirable).")
    max_samples: int | None = Field(
        None, ge=1, description="Use at most this many valid rows from the start of the dataset."
    )

    @model_validator(mode="before")
    @classmethod
    def _path_shorthand(cls, data: Any) -> Any:
        # `train: [a.jsonl, b.parquet]` in YAML is the common case; accept a bare path.
        return {"path": data} if isinstance(data, str) else data


# The keys of a row each offline command reads (DatasetSpec's *_key fields); rm and dpo read pairs,
# kd its SFT rows, prm its prompt (its steps and labels come from prm.steps_key and prm.labels_key).
COMMAND_KEYS = {
    "sft": ("input_key", "output_key", "messages_key", "system_key"),
    "kd": ("input_key", "output_key", "messages_key", "system_key"),
    "rm": ("input_key", "chosen_key", "rejected_key", "system_key"),
    "dpo": ("input_key", "chosen_key", "rejected_key", "system_key"),
    "kto": ("input_key", "output_key", "label_key", "system_key"),
    "prm": ("input_key",),
}


def refuse_keys_the_command_ignores(data: DataConfig, command: str) -> None:
    """A dataset key the command does not read (chosen_key in sft), given a value: refused naming it,
    where it would be accepted and ignored."""
    reads = COMMAND_KEYS[command]
    ignored = [f for f in DatasetSpec.model_fields if f.endswith("_key") and f not in reads]
    for field, specs in (("data.train", data.train), ("data.eval", data.eval)):
        for i, spec in enumerate(specs):
            unused = spec.set_away_from_default(ignored)
            if unused:
                raise ValueError(
                    f"{field}.{i}: {command} does not read {', '.join(unused)}; it reads {', '.join(reads)}"
                    + (" (and prm.steps_key, prm.labels_key)" if command == "prm" else "")
                )


class DataConfig(Section):
    """Datasets, formatting, tokenisation limits and batching layout."""

    train: list[DatasetSpec] = Field(
        ..., min_length=1, description="Training datasets (paths or {path, weight, keys...} mappings)."
    )
    eval: list[DatasetSpec] = Field(
        default_factory=list, description="Evaluation datasets; when empty, eval_fraction holds out part of train."
    )
    eval_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Fraction of each training dataset's valid rows held out for evaluation when no eval set is "
        "given (at least one row when > 0).",
    )
    format: Literal["chat", "plain"] = Field(
        "chat",
        description="chat: render rows with the tokenizer's chat template; plain: prompt_template + output + eos.",
    )
    prompt_template: str = Field(
        "{input}\n",
        description="Plain format: how the input text becomes the prompt; must contain {input} "
        "(write {{ and }} for literal braces).",
    )
    max_length: int = Field(2048, ge=2, description="Longest sample in tokens (prompt and response together).")
    truncation: Literal["error", "truncate", "drop"] = Field(
        "error",
        description="Rows over max_length: error stops; truncate keeps the prompt's end and the response's "
        "start; drop skips and counts them.",
    )
    min_response_tokens: int = Field(
        64,
        ge=1,
        description="With truncation='truncate', the prompt is cut to at most max_length - min_response_tokens "
        "tokens so the response keeps at least this many.",
    )
    loss: Literal["prompt_masked", "full"] = Field(
        "prompt_masked",
        description="prompt_masked: loss on response tokens only; full: loss on every token (pretraining style; "
        "plain-format rows may then omit the output key).",
    )
    add_eos: bool = Field(
        True,
        description="Plain format: append the tokenizer's eos token to the response (chat templates add their own).",
    )
    packing: bool = Field(
        True,
        description="Pack the samples of a micro-batch several to a row (first-fit, position ids restart per "
        "sample, rows right-padded) instead of one sample per row padded to the longest.",
    )
    pack_row_tokens: int = Field(
        0,
        ge=0,
        description="With packing, tokens per packed row; 0: one row per micro-batch where the model computes "
        "attention within each packed sample on its own (sdpa on Llama, Mistral, Qwen2, Qwen3 without a sliding "
        "window), else rows as long as the longest sample (a block mask costs the square of a row).",
    )
    skip_bad_rows: bool = Field(
        False,
        description="Skip invalid rows (a line that is not JSON or not UTF-8 text, a missing key, a wrong type, "
        "...) instead of stopping; they are counted by reason in the data statistics.",
    )
    shuffle: bool = Field(True, description="Reshuffle the training samples every epoch.")
    seed: int = Field(0, ge=0, description="Seed of shuffling, mixing and the eval hold-out.")

    @field_validator("train", "eval", mode="before")
    @classmethod
    def _single_dataset_shorthand(cls, value: Any) -> Any:
        return dataset_list(value)

    @field_validator("prompt_template")
    @classmethod
    def _template_has_only_input(cls, value: str) -> str:
        return check_prompt_template(value)

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        if self.truncation != "truncate":
            if self.set_away_from_default(["min_response_tokens"]):
                raise ValueError(
                    f"min_response_tokens ({self.min_response_tokens}) is read only with truncation: truncate "
                    f"(truncation is '{self.truncation}'); remove it or set truncation: truncate"
                )
        elif self.min_response_tokens >= self.max_length:
            raise ValueError(
                f"min_response_tokens ({self.min_response_tokens}) must be below max_length ({self.max_length})"
            )
        weighted = [spec.weight is not None for spec in self.train]
        if any(weighted) and not all(weighted):
            raise ValueError("set a weight on every train dataset or on none (none: each contributes all its rows)")
        if self.eval and self.eval_fraction > 0:
            raise ValueError("set either eval (separate eval datasets) or eval_fraction (held out of train), not both")
        refuse_plain_settings_under_chat(self, ["prompt_template", "add_eos"])
        return self
