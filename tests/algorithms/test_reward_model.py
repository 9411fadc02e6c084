"""Pairwise reward-model losses and the process-reward loss."""

from __future__ import annotations

import math

import pytest
import torch

from raylign.algorithms import bradley_terry_loss, log_exp_loss, process_reward_loss, step_separator_mask

from .helpers import fill_masked

CHOSEN = [1.0, 0.2, -0.5]
REJECTED = [0.0, 0.7, -2.0]


def t(values, requires_grad=False):
    return torch.tensor(values, dtype=torch.float64, requires_grad=requires_grad)


def test_bradley_terry_by_hand_with_margin_and_centering():
    loss, metrics = bradley_terry_loss(t(CHOSEN), t(REJECTED))
    expected = sum(math.log1p(math.exp(-(c - r))) for c, r in zip(CHOSEN, REJECTED)) / 3
    assert loss.item() == pytest.approx(expected)
    assert metrics["accuracy"].item() == pytest.approx(2 / 3)
    margins = [0.5, 0.0, 1.0]
    with_margin, _ = bradley_terry_loss(t(CHOSEN), t(REJECTED), margin=t(margins), center_coef=0.01)
    expected = sum(math.log1p(math.exp(-(c - r - m))) for c, r, m in zip(CHOSEN, REJECTED, margins)) / 3
    expected += 0.01 * sum((c + r) ** 2 for c, r in zip(CHOSEN, REJECTED)) / 3
    assert with_margin.item() == pytest.approx(expected)


def test_log_exp_loss_by_hand():
    loss, _ = log_exp_loss(t(CHOSEN), t(REJECTED), margin=0.3)
    expected = sum(math.log(1 + math.exp(r - c + 0.3)) for c, r in zip(CHOSEN, REJECTED)) / 3
    assert loss.item() == pytest.approx(expected)


def test_pairwise_losses_are_stable_for_large_gaps():
    loss, _ = log_exp_loss(t([0.0]), t([1000.0]))
    assert loss.item() == pytest.approx(1000.0)
    loss, _ = bradley_terry_loss(t([1000.0]), t([0.0]))
    assert loss.item() == pytest.approx(0.0)


@pytest.mark.parametrize("fn", [bradley_terry_loss, log_exp_loss])
def test_gradcheck_pairwise_rm_losses(fn):
    assert torch.autograd.gradcheck(lambda c, r: fn(c, r, margin=0.2)[0], (t(CHOSEN, True), t(REJECTED, True)))


def test_step_separator_mask():
    ids = torch.tensor([[5, 9, 3, 9], [9, 1, 1, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    assert step_separator_mask(ids, 9, mask).tolist() == [[False, True, False, True], [False, False, False, True]]


def py_ce(logits, target_distribution):
    z = sum(math.exp(x) for x in logits)
    return -sum(q * (x - math.log(z)) for x, q in zip(logits, target_distribution))


LOGITS = [[[0.1, 2.0], [1.0, -1.0], [0.0, 0.0]], [[3.0, 1.0], [0.5, 0.5], [-2.0, 2.0]]]
STEPS = [[1, 0, 1], [0, 1, 1]]


def prm_inputs():
    steps = torch.tensor(STEPS)
    return fill_masked(t(LOGITS), steps), steps


def test_process_reward_loss_with_hard_labels():
    logits, steps = prm_inputs()
    labels = torch.tensor([[1, -100, 0], [-100, 1, 1]])  # -100 at non-step positions must be ignored
    loss, metrics = process_reward_loss(logits, labels, steps)
    expected = [
        py_ce(LOGITS[0][0], [0, 1]),
        py_ce(LOGITS[0][2], [1, 0]),
        py_ce(LOGITS[1][1], [0, 1]),
        py_ce(LOGITS[1][2], [0, 1]),
    ]
    assert loss.item() == pytest.approx(sum(expected) / 4)
    # argmax: step (0,0) -> 1 ok; (0,2) tie -> 0 ok; (1,1) tie -> 0 wrong; (1,2) -> 1 ok
    assert metrics["step_accuracy"].item() == pytest.approx(3 / 4)


def test_process_reward_loss_with_soft_labels():
    logits, steps = prm_inputs()
    soft = fill_masked(t([[0.9, 0.0, 0.2], [0.0, 0.6, 1.0]]), steps)
    loss, _ = process_reward_loss(logits, soft, steps)
    expected = [
        py_ce(LOGITS[0][0], [0.1, 0.9]),
        py_ce(LOGITS[0][2], [0.8, 0.2]),
        py_ce(LOGITS[1][1], [0.4, 0.6]),
        py_ce(LOGITS[1][2], [0.0, 1.0]),
    ]
    assert loss.item() == pytest.approx(sum(expected) / 4)
    distribution = torch.stack([1 - soft, soft], dim=-1)
    loss_dist, _ = process_reward_loss(logits, fill_masked(distribution, steps), steps)
    assert loss_dist.item() == pytest.approx(sum(expected) / 4)


def test_gradcheck_process_reward_loss_and_no_gradient_off_steps():
    steps = torch.tensor(STEPS)
    logits = t(LOGITS, True)
    labels = t([[0.9, 0.0, 0.2], [0.0, 0.6, 1.0]])
    assert torch.autograd.gradcheck(lambda z: process_reward_loss(z, labels, steps)[0], (logits,))
    process_reward_loss(logits, labels, steps)[0].backward()
    assert logits.grad[steps == 0].abs().sum().item() == 0.0


def test_process_reward_loss_without_steps_is_zero():
    loss, metrics = process_reward_loss(t(LOGITS), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3))
    assert loss.item() == 0.0 and metrics["step_accuracy"].item() == 0.0


def test_bad_soft_label_shape_is_explained():
    with pytest.raises(ValueError, match="soft labels"):
        process_reward_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2), torch.ones(1, 2))
