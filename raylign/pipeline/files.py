"""The pipeline's JSONL files: checked reading of generation / scored rows and atomic writing.

Every row problem is a :class:`~raylign.data.RowError` naming the file, the row (the line
number of a ``.jsonl`` file) and the key.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from raylign.config.pipeline import GENERATION_KEYS, SCORE_KEYS
from raylign.data import RowRef, check_text, read_rows, require_key, require_list, validate_messages
from raylign.rl.prompts import data_source
from raylign.rollout.rewards.base import REWARD_ARGUMENTS, is_finite_number, short_repr
from raylign.rollout.rewards.rendering import PROMPT_MESSAGES_KEY

# The row key RL reads a prompt's data source from (data.source_key's default); raylign generate copies it.
DATA_SOURCE_KEY = "data_source"


@dataclass
class GeneratedRow:
    """One checked row of a generation (or scored) file; ``data`` is the row as read."""

    where: RowRef
    data: dict[str, Any]
    prompt: str | list[dict[str, str]]
    responses: list[str]

    @property
    def is_conversation(self) -> bool:
        return isinstance(self.prompt, list)

    def reward_prompt(self) -> str:
        """The prompt reward sources see: the rendered ``prompt_text`` (as in RL), else the prompt's own text."""
        rendered = self.data.get("prompt_text")
        if isinstance(rendered, str):
            return rendered
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[-1]["content"]  # a conversation without its rendering: its last turn

    def reward_metadata(self) -> dict[str, Any]:
        """What reward sources get beside the prompt, response and label, as in RL: the row's data ``source``
        (its ``data_source``, else this file's name without its suffix; a ``source`` key of the row wins), the
        row's own keys, and the conversation for reward models."""
        skip = set(GENERATION_KEYS) | set(SCORE_KEYS) | set(REWARD_ARGUMENTS)
        source = data_source(self.data, DATA_SOURCE_KEY, self.where.source)
        metadata = {"source": source, **{k: v for k, v in self.data.items() if k not in skip}}
        if isinstance(self.prompt, list):
            metadata[PROMPT_MESSAGES_KEY] = self.prompt
        return metadata


def _check_prompt(row: dict[str, Any], where: RowRef) -> str | list[dict[str, str]]:
    value = require_key(row, "prompt", where)
    if isinstance(value, list):
        return validate_messages(value, "prompt", where)
    return check_text(value, "prompt", where)


def _check_responses(row: dict[str, Any], where: RowRef) -> list[str]:
    responses = require_list(row, "responses", where)
    for i, response in enumerate(responses):
        if not isinstance(response, str):
            raise where.error(
                f"responses[{i}]", f"expected a string, got {type(response).__name__}: {response!r:.80}", "wrong_type"
            )
    return responses


def parse_generated_row(row: dict[str, Any], where: RowRef) -> GeneratedRow:
    """Check the keys every pipeline file has: ``prompt`` (text or conversation) and ``responses`` (texts)."""
    prompt = _check_prompt(row, where)
    responses = _check_responses(row, where)
    if row.get("prompt_text") is not None and not isinstance(row["prompt_text"], str):
        raise where.error("prompt_text", f"expected a string, got {type(row['prompt_text']).__name__}", "wrong_type")
    return GeneratedRow(where, row, prompt, responses)


def read_generated_rows(path: str | Path) -> Iterator[GeneratedRow]:
    """Checked rows of a file written by ``raylign generate`` (or ``raylign score``)."""
    count = 0
    for number, row in read_rows(path):
        count += 1
        yield parse_generated_row(row, RowRef(str(path), number))
    if count == 0:
        raise ValueError(f"{path}: no rows")


def parse_rewards(row: GeneratedRow) -> list[float]:
    """The row's ``rewards``: one finite number per response."""
    where = row.where
    rewards = require_list(row.data, "rewards", where)
    if len(rewards) != len(row.responses):
        raise where.error(
            "rewards",
            f"{len(rewards)} rewards for {len(row.responses)} responses; a scored row needs one reward per response",
            "length_mismatch",
        )
    for i, value in enumerate(rewards):
        if not is_finite_number(value):
            raise where.error(f"rewards[{i}]", f"expected a finite number, got {short_repr(value)}", "wrong_type")
    return [float(r) for r in rewards]


def require_kept_keys(row: GeneratedRow, keys: list[str]) -> dict[str, Any]:
    """``{key: row[key]}`` for each of ``keys``; a missing key is an error naming the row."""
    for key in keys:
        if key not in row.data:
            present = ", ".join(repr(k) for k in row.data)
            raise row.where.error(key, f"missing key to keep (keys present: {present})", "missing_key")
    return {key: row.data[key] for key in keys}


class JsonlWriter:
    """Writes rows to ``<path>.tmp`` and renames it to ``path`` when the block ends without an error.

    A failed run therefore never leaves a half-written file under the final name, and the
    output may be the file being read (it is replaced only at the end).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.rows = 0
        self._handle: Any = None

    def __enter__(self) -> JsonlWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self.tmp.open("w", encoding="utf-8")
        return self

    def write(self, row: dict[str, Any]) -> None:
        # default=str: values JSON has no type for (dates from a parquet dataset) are written as text.
        self._handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        self.rows += 1

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._handle.close()
        if kind is None:
            self.tmp.replace(self.path)
        else:
            self.tmp.unlink(missing_ok=True)


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
