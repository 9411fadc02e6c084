"""Training statistics that carry how they combine over micro-batches, ranks and updates.

A worker returns one :class:`Metric` per statistic of its optimizer step. The controller combines
the ranks' metrics of one update with :func:`combine`, then the updates of one RL step (mini-batches
times epochs) with :func:`average_updates`. Each metric's ``reduce`` says how:

* ``"mean"``: a mean over ``weight`` items (e.g. the counted tokens of a micro-batch), combined as
  the weighted mean: token means of micro-batches become the token mean of their union.
* ``"max"``: the largest value.
* ``"sum"``: shares of one update's total (e.g. a micro-batch's share of the batch loss), summed
  within an update; an RL step logs the mean of its updates' totals.
* ``"ess"``: Kish's effective sample size fraction of importance weights, carried as the sums
  ``N``, ``sum w`` and ``sum w^2`` (:func:`effective_sample_size`) and formed from the pooled sums:
  the fractions of parts do not average to that of their union (two micro-batches whose ratios
  are equal within each have fraction 1 each, whatever the spread between them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Reduce = Literal["mean", "max", "sum", "ess"]


@dataclass(frozen=True)
class Metric:
    """One statistic of one update and how it combines with others of its name (see the module)."""

    value: float
    reduce: Reduce = "mean"
    weight: float = 1.0  # "mean": how many items the value is a mean over; "ess": how many weights it counts
    sums: tuple[float, float] = (0.0, 0.0)  # "ess" only: the weights' sum and sum of squares


def effective_sample_size(count: float, weight_sum: float, weight_sq_sum: float) -> Metric:
    """Kish's effective sample size as a fraction of the ``count`` weights, ``(sum w)^2 / (N sum w^2)``:
    1 when all are equal, 1/N when one carries all (0 for no weights). Combined by adding the sums."""
    value = weight_sum**2 / (count * weight_sq_sum) if count > 0 and weight_sq_sum > 0 else 0.0
    return Metric(value, "ess", count, (weight_sum, weight_sq_sum))


def _combine_one(name: str, parts: Sequence[Metric]) -> Metric:
    kinds = {m.reduce for m in parts}
    if len(kinds) != 1:
        raise ValueError(f"metric {name!r} is reduced in different ways: {sorted(kinds)}")
    kind = kinds.pop()
    if kind == "max":
        return Metric(max(m.value for m in parts), "max")
    if kind == "sum":
        return Metric(sum(m.value for m in parts), "sum")
    if kind == "ess":
        count = sum(m.weight for m in parts)
        return effective_sample_size(count, sum(m.sums[0] for m in parts), sum(m.sums[1] for m in parts))
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
