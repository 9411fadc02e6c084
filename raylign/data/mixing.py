"""Weighted mixing of several datasets into one epoch, and holding out an eval split.

Mixing semantics: without weights, an epoch is every sample of every dataset once. With
weights, an epoch has ``N`` samples (by default the total size of the datasets).
Dataset ``i`` with weight ``w_i`` contributes ``c_i = N * w_i / sum(w)`` samples, rounded by
the largest-remainder rule so that the counts add up to exactly ``N`` (each within one of
its exact share). A dataset with fewer than ``c_i`` samples is upsampled: every sample
appears ``c_i // n_i`` times, and ``c_i % n_i`` distinct samples drawn under the seed appear
once more. A larger dataset is subsampled: ``c_i`` distinct samples drawn under the seed.
The same seed gives the same mixture; the sampler shuffles it per epoch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mixture_counts(weights: Sequence[float], total: int) -> list[int]:
    """Split ``total`` into integer shares proportional to ``weights`` (largest-remainder rounding)."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"mixing weights must be positive, got {list(weights)}")
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _draw(size: int, count: int, rng: np.random.Generator) -> list[int]:
    """``count`` indices into ``range(size)``: whole repeats plus a distinct random remainder, sorted."""
    repeats, remainder = divmod(count, size)
    extra = rng.choice(size, size=remainder, replace=False)
    picks = np.concatenate([np.tile(np.arange(size), repeats), extra])
    return sorted(int(i) for i in picks)


def mix_datasets(
    sizes: Sequence[int], weights: Sequence[float] | None = None, seed: int = 0, num_samples: int | None = None
) -> list[tuple[int, int]]:
    """One epoch of the weighted mixture as ``(dataset_index, sample_index)`` pairs.

    Pairs are grouped by dataset and sorted by sample index within one; shuffle them with
    the sampler. See the module docstring for the semantics.
    """
    if weights is None:
        if num_samples is not None:
            raise ValueError("num_samples needs weights (without them an epoch is every sample once)")
        return [(dataset, index) for dataset, size in enumerate(sizes) for index in range(size)]
    if len(sizes) != len(weights):
        raise ValueError(f"{len(sizes)} datasets but {len(weights)} weights")
    if any(n <= 0 for n in sizes):
        raise ValueError(f"cannot mix an empty dataset (sizes {list(sizes)})")
    total = sum(sizes) if num_samples is None else num_samples
    rng = np.random.default_rng(seed)
    mixture: list[tuple[int, int]] = []
    for dataset, (size, count) in enumerate(zip(sizes, mixture_counts(weights, total))):
        mixture.extend((dataset, index) for index in _draw(size, count, rng))
    return mixture


def split_holdout(num_samples: int, fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Split ``range(num_samples)`` into (train, eval) index lists, both sorted.

    The eval part has ``round(fraction * num_samples)`` indices, but at least one when
    ``fraction > 0`` and at most ``num_samples - 1``, so training keeps a sample.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"eval fraction must be in [0, 1), got {fraction}")
    num_eval = 0
    if fraction > 0:
        num_eval = min(max(1, round(fraction * num_samples)), num_samples - 1)
    order = np.random.default_rng(seed).permutation(num_samples)
    held_out = set(int(i) for i in order[:num_eval])
    train = [i for i in range(num_samples) if i not in held_out]
    return train, sorted(held_out)
