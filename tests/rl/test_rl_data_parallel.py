"""A policy on two data-parallel Ray workers makes the first update one process makes.

The same eight hand-made samples (with old log-probs and advantages) are split over two ranks as the
controller splits a mini-batch (``micro_batches_for_ranks`` + ``pack_samples``: token-balanced shards,
several micro-batches per rank), and into contiguous halves of very different token counts. One
``train_policy`` step runs on each layout, and the exported weights and gradient norms are compared
with a plain fp32 reference: the token-mean PPO loss of the whole batch in one process, and AdamW's
first step written out by hand. Which rank holds a sample must not matter.
"""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
import torch

from raylign.rl.experience import micro_batches_for_ranks, response_tensor
from raylign.rl.group import WorkerGroup

from .rl_helpers import fp32_model, make_sample, response_logprobs, shard_for_ranks, state_dict_of, worker_config

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
LR, CLIP = 1e-2, 0.2
# AdamW's first step is lr * g / (|g| + eps). With the default eps (1e-8) that is lr * sign(g), blind
# to how the gradient is scaled; with eps = 1, above every gradient entry here (the largest update is
# 1.6e-3 = lr * 0.2 / 1.2), it is nearly lr * g, so a gradient averaged per rank instead of over the
# global batch, or summed over ranks, moves weights by a different amount (up to ~1e-3).
ADAM_EPS = 1.0
# fp32 throughout; the layouts differ only in summation order (packing, micro-batches, the gradient
# all-reduce). That changes g by ~1e-7 relative and the update by ~1e-9 (updates are <= 1.6e-3).
# Measured: 4e-9 between layouts and against the reference, on both backends.
WEIGHT_ATOL = 1e-6
NORM_RTOL = 1e-5
MAX_TOKENS = 24  # micro-batch budget: 2-3 micro-batches per rank
# The eight samples in contiguous halves (44 and 26 tokens), two micro-batches each.
CONTIGUOUS = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
BACKENDS = [
    pytest.param("fsdp2", 2, id="fsdp2"),
    pytest.param(
        "deepspeed", 2, id="zero2", marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
    ),
]


def _samples() -> list:
    """Eight samples; the first four hold 30 response tokens, the last four 10. Balanced by tokens
    (34 and 36 in all), ranks hold 22 and 18 response tokens, still different."""
    rng = random.Random(0)
    lengths = [(3, 9), (5, 7), (2, 8), (4, 6), (6, 2), (3, 3), (5, 4), (2, 1)]
    return [
        make_sample([rng.randrange(10, 500) for _ in range(p)], [rng.randrange(10, 500) for _ in range(r)])
        for p, r in lengths
    ]


ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.75]


def _old_logprobs(model, samples) -> list[list[float]]:
    """The model's own log-probs shifted by up to +-0.3, so ratios reach past the clip range 1 +- 0.2."""
    generator = torch.Generator().manual_seed(1)
    old = []
    with torch.no_grad():
        for s in samples:
            lp = response_logprobs(model, s.prompt_ids, s.response_ids)
            old.append((lp + (torch.rand(lp.shape, generator=generator) - 0.5) * 0.6).tolist())
    return old


def _reference_update(model_dir, samples, old) -> tuple[dict[str, torch.Tensor], float]:
    """Weights after one AdamW step on the whole batch in one process, and the gradient norm.

    loss = sum_i sum_t max(-A_i r_it, -A_i clip(r_it, 1 - eps, 1 + eps)) / (number of tokens),
    r_it = exp(logp_it - old_it); AdamW step 1 (bias-corrected, no decay): w -= lr * g / (|g| + eps).
    """
    model = fp32_model(model_dir)
    total, tokens = torch.zeros(()), 0
    for s, old_row, advantage in zip(samples, old, ADVANTAGES):
        ratio = torch.exp(response_logprobs(model, s.prompt_ids, s.response_ids) - torch.tensor(old_row))
        total = total + torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - CLIP, 1 + CLIP)).sum()
        tokens += len(s.response_ids)
    (total / tokens).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    with torch.no_grad():
        for p in params:
            p -= LR * p.grad / (p.grad.abs() + ADAM_EPS)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norm


def _train_and_export(
    cfg, workers, samples, per_token, directory, plan=None
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    group = WorkerGroup("policy", cfg, workers, 1, None, env=ENV)
    try:
        shards = shard_for_ranks(samples, per_token, workers, MAX_TOKENS, plan=plan)
        stats = group.call_sharded("train_policy", shards)
        group.call("export_hf", str(directory))
    finally:
        group.kill()
    return state_dict_of(directory), stats


def _max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(("backend", "zero_stage"), BACKENDS)
def test_two_workers_make_the_first_update_of_one_process(
    backend, zero_stage, ray_session, rl_model_dir, prompt_file, tmp_path
):
    samples = _samples()
    old = _old_logprobs(fp32_model(rl_model_dir), samples)
    per_token = {
        "old_logprobs": response_tensor(old),
        "advantages": response_tensor([[a] * len(s.response_ids) for a, s in zip(ADVANTAGES, samples)]),
    }
    expected, expected_norm = _reference_update(rl_model_dir, samples, old)
    initial = state_dict_of(rl_model_dir)
    assert _max_gap(expected, initial) > 1e-4  # the step is large enough for the comparison to mean something

    results = {}
    for name, workers, plan in (("balanced", 2, None), ("contiguous", 2, CONTIGUOUS)):
        cfg = worker_config(
            rl_model_dir,
            prompt_file,
            tmp_path / f"run-{name}" / "run",
            backend,
            workers,
            zero_stage=zero_stage,
            optim={"lr": LR, "eps": ADAM_EPS, "max_grad_norm": 0.0, "scheduler": "constant"},
            algorithm={"aggregation": "token_mean", "clip_eps_low": CLIP},
        )
        results[name] = _train_and_export(cfg, workers, samples, per_token, tmp_path / f"export-{name}", plan)

    assert micro_batches_for_ranks(samples, 2, MAX_TOKENS) != CONTIGUOUS
    for name, (weights, _) in results.items():
        assert _max_gap(weights, expected) <= WEIGHT_ATOL, name
    all_stats = [stats for _, rank_stats in results.values() for stats in rank_stats]
    for stats in all_stats:
        assert stats["grad_norm"].value == pytest.approx(expected_norm, rel=NORM_RTOL)
    # some tokens were clipped, so the clipped branch of the loss took part
    assert max(s["clip_fraction"].value for s in all_stats) > 0
