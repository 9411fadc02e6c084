"""DPO family, SimPO, ORPO and KTO against plain-Python formulas."""

from __future__ import annotations

import math

import pytest
import torch

from raylign.algorithms import (
    conservative_dpo_loss,
    dpo_loss,
    dpo_nll_loss,
    ipo_loss,
    kto_loss,
    orpo_loss,
    simpo_loss,
)

PC = [-10.0, -20.0, -5.0]  # policy chosen (sums)
PR = [-12.0, -18.0, -9.0]  # policy rejected
RC = [-11.0, -19.0, -6.0]  # reference chosen
RR = [-11.5, -19.5, -7.0]  # reference rejected
LEN_C = [4, 10, 2]
LEN_R = [5, 6, 3]


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def t(values, requires_grad=False):
    return torch.tensor(values, dtype=torch.float64, requires_grad=requires_grad)


def py_mean(xs):
    return sum(xs) / len(xs)


def h(i):
    return (PC[i] - RC[i]) - (PR[i] - RR[i])


def test_dpo_sigmoid_loss_and_metrics():
    loss, metrics = dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=0.1)
    assert loss.item() == pytest.approx(py_mean([-log_sigmoid(0.1 * h(i)) for i in range(3)]))
    assert metrics["rewards_chosen"].item() == pytest.approx(py_mean([0.1 * (PC[i] - RC[i]) for i in range(3)]))
    accuracy = py_mean([float(PC[i] - RC[i] > PR[i] - RR[i]) for i in range(3)])
    assert metrics["reward_accuracy"].item() == pytest.approx(accuracy)


def test_conservative_dpo_uses_label_smoothing():
    loss, _ = conservative_dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=0.5, label_smoothing=0.2)
    expected = py_mean([-0.8 * log_sigmoid(0.5 * h(i)) - 0.2 * log_sigmoid(-0.5 * h(i)) for i in range(3)])
    assert loss.item() == pytest.approx(expected)


def test_ipo_on_average_log_ratios():
    loss, _ = ipo_loss(t(PC), t(PR), t(RC), t(RR), beta=0.1, chosen_lengths=t(LEN_C), rejected_lengths=t(LEN_R))
    diffs = [(PC[i] - RC[i]) / LEN_C[i] - (PR[i] - RR[i]) / LEN_R[i] for i in range(3)]
    assert loss.item() == pytest.approx(py_mean([(d - 1 / 0.2) ** 2 for d in diffs]))


def test_dpo_plus_nll_adds_mean_per_token_nll_of_chosen():
    loss, metrics = dpo_nll_loss(t(PC), t(PR), t(RC), t(RR), chosen_lengths=t(LEN_C), beta=0.1, nll_coef=0.5)
    dpo = py_mean([-log_sigmoid(0.1 * h(i)) for i in range(3)])
    nll = py_mean([-PC[i] / LEN_C[i] for i in range(3)])
    assert loss.item() == pytest.approx(dpo + 0.5 * nll)
    assert metrics["nll"].item() == pytest.approx(nll)


def test_simpo_with_sums_and_lengths_equals_simpo_with_averages():
    by_lengths, _ = simpo_loss(t(PC), t(PR), chosen_lengths=t(LEN_C), rejected_lengths=t(LEN_R), beta=2.0, gamma=0.5)
    avg_c = [PC[i] / LEN_C[i] for i in range(3)]
    avg_r = [PR[i] / LEN_R[i] for i in range(3)]
    by_average, _ = simpo_loss(t(avg_c), t(avg_r), beta=2.0, gamma=0.5)
    expected = py_mean([-log_sigmoid(2.0 * (avg_c[i] - avg_r[i]) - 0.5) for i in range(3)])
    assert by_lengths.item() == pytest.approx(expected)
    assert by_average.item() == pytest.approx(expected)


def test_orpo_log_odds_ratio_and_nll():
    avg_c = [PC[i] / LEN_C[i] for i in range(3)]
    avg_r = [PR[i] / LEN_R[i] for i in range(3)]

    def log_odds(lp):
        return lp - math.log(1 - math.exp(lp))

    odds_terms = [log_sigmoid(log_odds(avg_c[i]) - log_odds(avg_r[i])) for i in range(3)]
    loss, metrics = orpo_loss(t(avg_c), t(avg_r), lam=0.1)
    assert loss.item() == pytest.approx(py_mean([-a for a in avg_c]) - 0.1 * py_mean(odds_terms))
    token_loss, _ = orpo_loss(t(PC), t(PR), lam=0.1, chosen_lengths=t(LEN_C), rejected_lengths=t(LEN_R))
    assert token_loss.item() == pytest.approx(-sum(PC) / sum(LEN_C) - 0.1 * py_mean(odds_terms))
    assert metrics["log_odds_ratio"].item() == pytest.approx(
        py_mean([log_odds(avg_c[i]) - log_odds(avg_r[i]) for i in range(3)])
    )


def test_orpo_is_finite_when_a_response_is_certain():
    """p = 1 would make the odds infinite: log p is held at -1e-7 or below in the odds, not in the NLL."""
    loss, metrics = orpo_loss(t([0.0, -1e-12]), t([-1.0, -2.0]), lam=0.1)
    held = -1e-7
    log_odds = [(held - r) - (math.log(-math.expm1(held)) - math.log(-math.expm1(r))) for r in (-1.0, -2.0)]
    odds_term = sum(-math.log1p(math.exp(-x)) for x in log_odds) / 2  # log sigmoid, both pairs
    assert loss.item() == pytest.approx(5e-13 - 0.1 * odds_term, rel=1e-9)
    assert metrics["log_odds_ratio"].item() == pytest.approx(sum(log_odds) / 2, rel=1e-12)


def test_kto_by_hand_with_batch_kl():
    policy, ref = [-3.0, -5.0, -2.0, -4.0], [-3.5, -4.0, -2.5, -3.0]
    desirable = [True, False, True, False]
    policy_kl, ref_kl = [-6.0, -7.0], [-6.4, -7.2]
    z0 = max(0.0, py_mean([policy_kl[j] - ref_kl[j] for j in range(2)]))
    expected = []
    for i in range(4):
        r = policy[i] - ref[i]
        if desirable[i]:
            expected.append(1.0 * (1 - 1 / (1 + math.exp(-0.1 * (r - z0)))))
        else:
            expected.append(1.5 * (1 - 1 / (1 + math.exp(-0.1 * (z0 - r)))))
    loss, metrics = kto_loss(
        t(policy),
        t(ref),
        torch.tensor(desirable),
        policy_kl_logps=t(policy_kl),
        ref_kl_logps=t(ref_kl),
        beta=0.1,
        desirable_weight=1.0,
        undesirable_weight=1.5,
    )
    assert loss.item() == pytest.approx(py_mean(expected))
    assert metrics["kl"].item() == pytest.approx(z0)


def test_kto_kl_estimate_is_clamped_at_zero_and_detached():
    policy_kl = t([-7.0, -8.0], requires_grad=True)
    _, metrics = kto_loss(
        t([-1.0]), t([-1.0]), torch.tensor([True]), policy_kl_logps=policy_kl, ref_kl_logps=t([-6.0, -7.0])
    )
    assert metrics["kl"].item() == 0.0
    with pytest.raises(ValueError, match="both"):
        kto_loss(t([-1.0]), t([-1.0]), torch.tensor([True]), policy_kl_logps=policy_kl)


PAIRWISE = {
    "dpo": lambda c, r: dpo_loss(c, r, t(RC), t(RR), beta=0.3)[0],
    "cdpo": lambda c, r: conservative_dpo_loss(c, r, t(RC), t(RR), beta=0.3)[0],
    "ipo": lambda c, r: ipo_loss(c, r, t(RC), t(RR), chosen_lengths=t(LEN_C), rejected_lengths=t(LEN_R))[0],
    "dpo_nll": lambda c, r: dpo_nll_loss(c, r, t(RC), t(RR), chosen_lengths=t(LEN_C))[0],
    "simpo": lambda c, r: simpo_loss(c, r, chosen_lengths=t(LEN_C), rejected_lengths=t(LEN_R))[0],
    "orpo": lambda c, r: orpo_loss(c, r, chosen_lengths=t(LEN_C), rejected_lengths=t(LEN_R))[0],
}


@pytest.mark.parametrize("name", sorted(PAIRWISE))
def test_gradcheck_pairwise_preference_losses(name):
    assert torch.autograd.gradcheck(PAIRWISE[name], (t(PC, True), t(PR, True)))


def test_gradcheck_kto():
    def loss(policy):
        return kto_loss(
            policy,
            t([-3.5, -4.0, -2.5]),
            torch.tensor([True, False, True]),
            policy_kl_logps=t([-6.0, -5.0]),
            ref_kl_logps=t([-6.5, -5.2]),
        )[0]

    assert torch.autograd.gradcheck(loss, (t([-3.0, -5.0, -2.0], True),))


def test_reference_log_probs_get_no_gradient():
    ref_c = t(RC, True)
    loss, _ = dpo_loss(t(PC, True), t(PR), ref_c, t(RR))
    loss.backward()
    assert ref_c.grad is None


def test_mismatched_shapes_are_named():
    with pytest.raises(ValueError, match="ref_rejected_logps"):
        dpo_loss(t(PC), t(PR), t(RC), t([1.0]))
