"""Group layout and per-group statistics."""

from __future__ import annotations

import math

import pytest
import torch

from raylign.algorithms import group_stats, resolve_group_ids


def test_group_size_gives_consecutive_groups():
    assert resolve_group_ids(6, group_size=2).tolist() == [0, 0, 1, 1, 2, 2]


def test_group_ids_are_made_dense_in_sorted_id_order():
    assert resolve_group_ids(5, group_ids=torch.tensor([42, 7, 42, 100, 7])).tolist() == [1, 0, 1, 2, 0]


def test_bad_group_ids_are_explained():
    with pytest.raises(ValueError, match=r"group_ids must be \[batch\] = \[3\]"):
        resolve_group_ids(3, group_ids=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="integers"):
        resolve_group_ids(2, group_ids=torch.tensor([0.0, 1.0]))


def test_group_stats_by_hand():
    values = torch.tensor([1.0, 3.0, 2.0, 5.0, 5.0, 9.0])
    stats = group_stats(values, torch.tensor([0, 0, 1, 1, 1, 2]))
    assert stats.mean.tolist() == pytest.approx([2.0, 2.0, 4.0, 4.0, 4.0, 9.0])
    assert stats.std.tolist() == pytest.approx([math.sqrt(2)] * 2 + [math.sqrt(3)] * 3 + [0.0])
    assert stats.size.tolist() == [2, 2, 3, 3, 3, 1]
    assert stats.total.tolist() == [4, 4, 12, 12, 12, 9]
    assert stats.spread.tolist() == [2, 2, 3, 3, 3, 0]
    assert stats.has_signal.tolist() == [True] * 5 + [False]
