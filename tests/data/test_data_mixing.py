"""Dataset mixing and the eval hold-out."""

from __future__ import annotations

from collections import Counter

import pytest

from raylign.data import mix_datasets, mixture_counts, split_holdout


def test_large_mixture_matches_the_weights_within_one_sample_per_dataset():
    # Tolerance: each dataset's share of the epoch is within 1/N of w_i / sum(w).
    sizes, weights = [5000, 700, 333], [0.5, 0.3, 0.2]
    mixture = mix_datasets(sizes, weights, seed=3)
    total = sum(sizes)
    assert len(mixture) == total
    counts = Counter(d for d, _ in mixture)
    for dataset, weight in enumerate(weights):
        assert abs(counts[dataset] / total - weight / sum(weights)) <= 1 / total


def test_small_dataset_is_upsampled_evenly_and_large_one_subsampled_without_repeats():
    mixture = mix_datasets([5000, 700, 333], [0.5, 0.3, 0.2], seed=3)
    per_sample = Counter(mixture)
    small = [per_sample[(1, i)] for i in range(700)]  # 6033 * 0.3 = 1809.9 -> 1810 = 2 * 700 + 410
    assert sorted(set(small)) == [2, 3] and small.count(3) == 410
    # 6033 * 0.5 = 3016.5; the two spare samples go to the larger remainders .9 and .6, so 3016
    large = [n for (d, _), n in per_sample.items() if d == 0]
    assert set(large) == {1} and len(large) == 3016


def test_indices_stay_inside_their_dataset():
    sizes = [10, 3]
    mixture = mix_datasets(sizes, [1, 3], seed=0)
    assert all(0 <= index < sizes[dataset] for dataset, index in mixture)


def test_largest_remainder_rounding_adds_up_to_the_total():
    assert mixture_counts([1, 1, 1], 10) == [4, 3, 3]
    assert mixture_counts([2, 1], 10) == [7, 3]
    assert mixture_counts([1, 1], 7) == [4, 3]


def test_mixing_is_deterministic_under_a_seed_and_changes_with_it():
    first = mix_datasets([100, 40], [1, 1], seed=7)
    assert mix_datasets([100, 40], [1, 1], seed=7) == first
    assert mix_datasets([100, 40], [1, 1], seed=8) != first


def test_without_weights_every_sample_appears_once_in_order():
    assert mix_datasets([2, 3]) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]


def test_bad_weights_are_rejected():
    with pytest.raises(ValueError, match="mixing weights must be positive"):
        mix_datasets([3, 3], [1, 0])
    with pytest.raises(ValueError, match="2 datasets but 1 weights"):
        mix_datasets([3, 3], [1])


@pytest.mark.parametrize(("n", "fraction", "expected_eval"), [(100, 0.1, 10), (7, 0.01, 1), (3, 0.9, 2), (1, 0.5, 0)])
def test_holdout_sizes_are_right_and_the_parts_disjoint(n, fraction, expected_eval):
    train, held_out = split_holdout(n, fraction, seed=1)
    assert len(held_out) == expected_eval
    assert sorted(train + held_out) == list(range(n))
