"""Evaluation metrics: pass@k per data source (Chen et al. 2021, "Evaluating Large Language
Models Trained on Code", unbiased estimator)."""

from __future__ import annotations

from collections import defaultdict
from math import comb, isfinite
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n - c, k) / C(n, k)``: the chance that at least one of k samples drawn from n is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_at_k_metrics(samples: list[Any], n: int, threshold: float) -> dict[str, float]:
    """``eval/<source>/pass@1``, ``pass@n``, mean reward and mean response length (tokens) per data
    source, and over all sources (``eval/all/...``).

    ``samples`` come in groups of ``n`` consecutive completions per prompt. A group with a reward
    that is NaN or infinite (``reward.non_finite: drop``) is left out and counted in
    ``eval/<source>/non_finite_groups`` (a key only present when there was one)."""
    per_source: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    non_finite: dict[str, int] = defaultdict(int)
    for g in range(len(samples) // n):
        group = samples[g * n : (g + 1) * n]
        if not all(isfinite(s.reward) for s in group):
            non_finite[group[0].source] += 1
            non_finite["all"] += 1
            continue
        correct = sum(s.reward >= threshold for s in group)
        mean_reward = sum(s.reward for s in group) / n
        mean_length = sum(len(s.response_ids) for s in group) / n
        per_source[group[0].source].append((correct, mean_reward, mean_length))
        per_source["all"].append((correct, mean_reward, mean_length))
    metrics: dict[str, float] = {}
    ks = sorted({1, n})
    for source, groups in per_source.items():
        for k in ks:
            metrics[f"eval/{source}/pass@{k}"] = sum(pass_at_k(n, c, k) for c, _, _ in groups) / len(groups)
        metrics[f"eval/{source}/reward_mean"] = sum(r for _, r, _ in groups) / len(groups)
        metrics[f"eval/{source}/response_length"] = sum(length for _, _, length in groups) / len(groups)
    metrics.update({f"eval/{source}/non_finite_groups": float(count) for source, count in non_finite.items()})
    return metrics
