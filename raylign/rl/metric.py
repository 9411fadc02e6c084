"""Training statistics that carry how they combine over micro-batches, ranks and updates.

A worker returns one :class:`Metric` per statistic of its optimizer step. The controller combines
the ranks' metrics of one update with :func:`combine`, then the updates of one RL step (mini-batches
times epochs) with :func:`average_updates`. Each metric's ``reduce`` says how:

* ``"mean"``: a mean over ``weight`` items (e.g. the counted tokens of a micro-batch), combined as
  the weighted mean: token means of micro-batches become the token mean of their union.
* ``"max"``: the largest value.
* ``"sum"``: shares of one update's total (e.g. a micro-batch's share of the batch loss), summed
  within an update; an RL step logs the mean of its updates' totals.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Reduce = Literal["mean", "max", "sum"]


@dataclass(frozen=True)
class Metric:
    """One statistic of one update and how it combines with others of its name (see the module)."""

    value: float
    reduce: Reduce = "mean"
    weight: float = 1.0  # "mean" only: how many items the value is a mean over


def _combine_one(name: str, parts: Sequence[Metric]) -> Metric:
    kinds = {m.reduce for m in parts}
    if len(kinds) != 1:
        raise ValueError(f"metric {name!r} is reduced in different ways: {sorted(kinds)}")
    kind = kinds.pop()
    if kind == "max":
        return Metric(max(m.value for m in parts), "max")
    if kind == "sum":
        return Metric(sum(m.value for m in parts), "sum")
    weight = sum(m.weight for m in parts)
    value = sum(m.value * m.weight for m in parts) / weight if weight > 0 else 0.0
    return Metric(value, "mean", weight)


def _by_name(parts: Iterable[dict[str, Metric]]) -> dict[str, list[Metric]]:
    grouped: dict[str, list[Metric]] = defaultdict(list)
    for part in parts:
        for name, metric in part.items():
            grouped[name].append(metric)
    return grouped


def combine(parts: Iterable[dict[str, Metric]]) -> dict[str, Metric]:
    """The micro-batches or ranks of one update as one metric per name: weighted means, maxima, sums."""
    return {name: _combine_one(name, metrics) for name, metrics in _by_name(parts).items()}


def average_updates(updates: Iterable[dict[str, Metric]]) -> dict[str, float]:
    """The updates of one RL step as one value per name: each update's total averaged (``"sum"``),
    the weighted mean (``"mean"``) or the maximum (``"max"``)."""
    values = {}
    for name, metrics in _by_name(updates).items():
        combined = _combine_one(name, metrics)
        values[name] = combined.value / len(metrics) if combined.reduce == "sum" else combined.value
    return values
