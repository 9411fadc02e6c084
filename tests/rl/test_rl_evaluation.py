"""Eval metrics per data source: pass@k (unbiased estimator), mean reward and response length."""

from __future__ import annotations

import pytest

from raylign.rl.evaluation import pass_at_k, pass_at_k_metrics

from .rl_helpers import make_sample


def _sample(source: str, reward: float, length: int):
    s = make_sample([1, 2], [3] * length)
    s.source, s.reward = source, reward
    return s


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong samples than k
    with pytest.raises(ValueError, match="pass@5 needs at least 5"):
        pass_at_k(4, 1, 5)


def test_metrics_per_source_and_overall_by_hand():
    # Groups of 2: "a" has prompts with 1/2 and 2/2 right, "b" one prompt with 0/2 right.
    samples = [
        _sample("a", 1.0, 4),
        _sample("a", 0.0, 2),
        _sample("a", 1.0, 6),
        _sample("a", 1.0, 6),
        _sample("b", 0.5, 3),
        _sample("b", 0.0, 1),
    ]
    metrics = pass_at_k_metrics(samples, n=2, threshold=1.0)
    expected = {
        # pass@1 = mean of c/n; pass@2 = 1 if any right
        "eval/a/pass@1": (0.5 + 1.0) / 2,
        "eval/a/pass@2": 1.0,
        "eval/a/reward_mean": (0.5 + 1.0) / 2,
        "eval/a/response_length": (3 + 6) / 2,
        "eval/b/pass@1": 0.0,
        "eval/b/pass@2": 0.0,
        "eval/b/reward_mean": 0.25,
        "eval/b/response_length": 2.0,
        "eval/all/pass@1": 1.5 / 3,
        "eval/all/pass@2": 2 / 3,
        "eval/all/reward_mean": 1.75 / 3,
        "eval/all/response_length": 11 / 3,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value), key
