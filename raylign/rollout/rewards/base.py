"""The interface every reward source implements, and the checks shared by all of them.

A source scores a batch of (prompt, response, label, metadata) samples and returns one float
per sample plus optional per-sample metrics. A source that cannot score raises
:class:`RewardError` naming the sample and the cause; it never returns ``None`` or a default.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# What a reward function receives by position; a prompt row's other fields come by keyword and must
# not reuse these names.
REWARD_ARGUMENTS = ("prompts", "responses", "labels")
# A request header of raylign's HTTP source under reward.non_finite: drop: NaN and infinite rewards are
# answered as they are (as JSON's NaN / Infinity extensions), not refused.
KEEP_NON_FINITE_HEADER = "X-Raylign-Keep-Non-Finite"


class RewardError(RuntimeError):
    """A reward source failed; the message names the source, the sample(s) and the cause."""


@dataclass
class RewardResult:
    """One reward per sample, and named per-sample metrics (each as long as ``rewards``)."""

    rewards: list[float]
    metrics: dict[str, list[float]] = field(default_factory=dict)


def preview(text: Any, limit: int = 60) -> str:
    """A short quoted form of a prompt for error messages."""
    text = str(text)
    short = text if len(text) <= limit else text[: limit - 3] + "..."
    return repr(short)


def describe_sample(prompts: Sequence[str], index: int, offset: int = 0) -> str:
    """'sample 3 (prompt 'What is ...')' for sample ``index`` of ``prompts``; ``offset`` shifts the number."""
    return f"sample {offset + index} (prompt {preview(prompts[index])})"


def describe_batch(prompts: Sequence[str], offset: int = 0) -> str:
    """'4 samples starting at sample 8 (prompt '...')': the size and first prompt of a batch."""
    count = len(prompts)
    noun = "sample" if count == 1 else "samples"
    return f"{count} {noun} starting at {describe_sample(prompts, 0, offset)}"


def check_batch(
    prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any], metadata: Sequence[dict]
) -> None:
    """Equal lengths, string prompts and responses, dict metadata; else ValueError naming the sample."""
    lengths = {"prompts": len(prompts), "responses": len(responses), "labels": len(labels), "metadata": len(metadata)}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"reward batch lists differ in length: {lengths}")
    for i, (prompt, response, meta) in enumerate(zip(prompts, responses, metadata)):
        if not isinstance(prompt, str):
            raise ValueError(f"sample {i}: prompt must be a string, got {type(prompt).__name__}")
        if not isinstance(response, str):
            raise ValueError(f"{describe_sample(prompts, i)}: response must be a string, got {type(response).__name__}")
        if not isinstance(meta, dict):
            raise ValueError(f"{describe_sample(prompts, i)}: metadata must be a dict, got {type(meta).__name__}")


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages."""
    try:
        text = repr(value)
    except ValueError:  # e.g. an integer with more digits than Python turns into text
        if isinstance(value, int):
            return f"an integer of about {int(value.bit_length() * math.log10(2))} digits"
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_sequence(values: Any) -> list[Any] | tuple[Any, ...] | None:
    """``values`` when it is a list or tuple, a 1-d numpy array or tensor as a list; else None."""
    if isinstance(values, (list, tuple)):
        return values
    if getattr(values, "ndim", None) == 1 and hasattr(values, "tolist"):
        return values.tolist()
    return None


def is_finite_number(value: Any) -> bool:
    """A JSON-style number: an int or float, not a bool, finite as a float (an integer beyond the float
    range is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(_as_number(value) or 0.0)


def _as_number(value: Any) -> float | None:
    """A real number (bools count as 0/1), numpy scalar or 0-d array/tensor as a float; else None.

    Text is not a number here, even text that float() would read: a reward function that returns
    strings is more likely wrong than meaning them as numbers.
    """
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range
        return math.inf


def to_float_list(
    values: Any, expected_len: int, what: str, prompts: Sequence[str], offset: int = 0, finite: bool = True
) -> list[float]:
    """``values`` as a list of finite floats of length ``expected_len``; else RewardError saying ``what`` was wrong.
    ``finite=False`` lets NaN and infinities through (``reward.non_finite: drop``).

    Accepts a list or tuple of numbers, or a 1-d numpy array or tensor (bools count as 0/1). Sets,
    mappings, text, 0-d or 2-d arrays, and elements that are text or nested sequences are refused.
    """
    sequence = _as_sequence(values)
    if sequence is None:
        shape = getattr(values, "shape", None)
        kind = type(values).__name__ + (f" of shape {tuple(shape)}" if shape is not None else "")
        raise RewardError(f"{what}: expected a list of {expected_len} numbers, got {kind}")
    if len(sequence) != expected_len:
        raise RewardError(f"{what}: expected {expected_len} values (one per sample), got {len(sequence)}")
    out: list[float] = []
    for i, value in enumerate(sequence):
        number = _as_number(value)
        if number is None:
            raise RewardError(
                f"{what}: value for {describe_sample(prompts, i, offset)} is not a number: {short_repr(value)}"
            )
        if finite and not math.isfinite(number):
            raise RewardError(
                f"{what}: value for {describe_sample(prompts, i, offset)} is not a finite number: {short_repr(value)}"
            )
        out.append(number)
    return out


def concatenate_results(parts: list[RewardResult], description: str) -> RewardResult:
    """One result from the results of consecutive chunks of a batch, which must report the same metrics."""
    names = list(parts[0].metrics)
    if any(set(p.metrics) != set(names) for p in parts):
        seen = [sorted(p.metrics) for p in parts]
        raise RewardError(f"{description}: chunks of one batch reported different metrics: {seen}")
    return RewardResult(
        rewards=[r for p in parts for r in p.rewards],
        metrics={n: [v for p in parts for v in p.metrics[n]] for n in names},
    )


class RewardSource(ABC):
    """Scores batches of samples. Subclasses implement :meth:`_score`; :meth:`score` checks in and out."""

    #: Names the source in errors, e.g. "reward function 'reward_func' in /path/r.py".
    description: str = "reward source"
    #: Worker processes or actors restarted after they died mid-batch (the batch was scored again).
    restarts: int = 0
    #: NaN and infinite values are returned as they are, not an error (``reward.non_finite: drop``).
    keep_non_finite: bool = False

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        labels: list[Any] | None = None,
        metadata: list[dict] | None = None,
    ) -> RewardResult:
        """Rewards for each (prompt, response) with its label and metadata (``None``: no labels / empty dicts)."""
        labels = [None] * len(prompts) if labels is None else list(labels)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        check_batch(prompts, responses, labels, metadata)
        if not prompts:
            return RewardResult(rewards=[], metrics={})
        result = self._score(list(prompts), list(responses), labels, metadata)
        finite = not self.keep_non_finite
        rewards = to_float_list(result.rewards, len(prompts), f"{self.description}: rewards", prompts, finite=finite)
        metrics = {
            name: to_float_list(values, len(prompts), f"{self.description}: metric '{name}'", prompts, finite=finite)
            for name, values in result.metrics.items()
        }
        return RewardResult(rewards=rewards, metrics=metrics)

    @abstractmethod
    def _score(self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]) -> RewardResult:
        """Score a checked, non-empty batch."""

    def close(self) -> None:  # noqa: B027 - an optional hook
        """Release worker processes, actors or connections; the source cannot score afterwards."""

    def __enter__(self) -> RewardSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
