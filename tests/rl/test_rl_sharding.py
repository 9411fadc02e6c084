"""How a step's samples are split over data-parallel ranks: token-balanced, with the same gradient.

Ranks wait for each other at every collective, so a step lasts as long as its busiest rank. GRPO
groups are consecutive and share a prompt, so contiguous shards of equal sample counts can hold
very different token counts; the split balances tokens instead. Every loss is normalised by the
counts of the whole step, so which rank holds a sample does not change the update.
"""

from __future__ import annotations

import pytest
import torch

from raylign.algorithms import LossScale, aggregate_loss
from raylign.rl.experience import micro_batches_for_ranks, response_tensor, token_balanced_shards

from .rl_helpers import make_sample


def test_token_balanced_shards_by_hand():
    # Four GRPO groups of two: two long prompts, then two short ones. Contiguous halves hold
    # 30 + 32 + 28 + 31 = 121 and 5 + 6 + 4 + 7 = 22 tokens.
    # Longest first onto the lighter rank (the lower on a tie), four samples at most per rank:
    # 32 -> r0 (32), 31 -> r1 (31), 30 -> r1 (61), 28 -> r0 (60), 7 -> r0 (67), 6 -> r1 (67),
    # 5 -> r0 (72, full), 4 -> r1 (71).
    lengths = [30, 32, 28, 31, 5, 6, 4, 7]
    shards = token_balanced_shards(lengths, 2)
    assert shards == [[1, 2, 4, 7], [0, 3, 5, 6]]
    assert [sum(lengths[i] for i in s) for s in shards] == [72, 71]


def test_every_rank_keeps_its_share_of_samples():
    # Five samples on two ranks: three on rank 0, two on rank 1, whatever their lengths.
    # 10 -> r0 (10), 9 -> r1 (9), 1 -> r1 (10), 1 -> r0 (11, tie to the lower rank),
    # 1 -> r0 (12): rank 1 already holds its two.
    assert token_balanced_shards([10, 1, 1, 1, 9], 2) == [[0, 2, 3], [1, 4]]
    assert token_balanced_shards([3, 1, 2], 1) == [[0, 1, 2]]
    assert token_balanced_shards([5, 4], 3) == [[0], [1], []]


def test_micro_batches_for_ranks_balance_tokens_with_the_same_micro_batch_count():
    # (prompt, response) lengths of the contract tests: 12, 12, 10, 10, 8, 6, 9, 3 tokens. By hand:
    # 12 -> r0, 12 -> r1, 10 -> r0 (22), 10 -> r1 (22), 9 -> r0 (31), 8 -> r1 (30), 6 -> r1 (36),
    # 3 -> r0 (34). Contiguous halves would hold 44 and 26 tokens.
    lengths = [(3, 9), (5, 7), (2, 8), (4, 6), (6, 2), (3, 3), (5, 4), (2, 1)]
    samples = [make_sample([1] * p, [2] * r) for p, r in lengths]
    plan = micro_batches_for_ranks(samples, 2, 24)
    assert [sorted(i for micro in rank for i in micro) for rank in plan] == [[0, 2, 6, 7], [1, 3, 4, 5]]
    assert [len(rank) for rank in plan] == [2, 2]  # 34 and 36 tokens in micro-batches of at most 24
    for rank in plan:
        for micro in rank:
            assert sum(sum(lengths[i]) for i in micro) <= 24


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_normalizer"])
def test_the_gradient_does_not_depend_on_which_rank_holds_a_sample(mode):
    """The gradient the optimizer sees (micro-batch losses summed per rank, averaged over ranks) with
    the token-balanced split, with contiguous halves, and the one-big-batch gradient written out:
    token_mean 1 / N_tok, seq_mean_token_mean 1 / (|y_i| N_seq), seq_mean_token_sum 1 / N_seq,
    constant_normalizer 1 / (N_seq L) at every counted token."""
    lengths = [(3, 9), (5, 7), (2, 8), (4, 6), (6, 2), (3, 3), (5, 4), (2, 1)]
    samples = [make_sample([1] * p, [2] * r) for p, r in lengths]
    mask = response_tensor([[1.0] * r for _, r in lengths])
    responses = torch.tensor([float(r) for _, r in lengths]).unsqueeze(-1)
    tokens, sequences, max_len, world = 40.0, 8.0, 16, 2
    expected = {
        "token_mean": mask / tokens,
        "seq_mean_token_mean": mask / (responses * sequences),
        "seq_mean_token_sum": mask / sequences,
        "constant_normalizer": mask / (sequences * max_len),
    }[mode]
    scale = LossScale(tokens, sequences, world, max_len)
    layouts = {
        "token-balanced": micro_batches_for_ranks(samples, world, 24),
        "contiguous": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
    }
    assert layouts["token-balanced"] != layouts["contiguous"]
    token_losses = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for name, plan in layouts.items():
        # each rank sums its micro-batches' gradients; the backend averages the ranks'
        step = sum(aggregate_loss(token_losses[micro], mask[micro], mode, scale) for rank in plan for micro in rank)
        (grad,) = torch.autograd.grad(step / world, token_losses)
        torch.testing.assert_close(grad, expected, atol=1e-7, rtol=0, msg=name)
