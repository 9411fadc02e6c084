"""Properties of the algorithm library that hold for every input, checked on generated cases.

* finite inputs and any mask (rows without a counted token included) give finite outputs and
  gradients;
* values at masked positions never change a result: garbage (NaN, inf, 1e30) there gives the
  same outputs, bit for bit, and the gradient there is 0;
* whitening and the group advantage estimators are invariant to adding a constant to all
  rewards, and equal rewards give exactly 0 advantage.

Rewards for the exactness claims lie on a grid of quarters, so adding a constant is exact in
floating point and equal-or-not is decided the same way before and after the shift. The cases
tried per test are counted and listed in the terminal summary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import raylign.algorithms as alg
from raylign.algorithms import LossScale
from raylign.algorithms.off_policy import LEVELS
from raylign.models import entropy_from_logits
from tests import case_counts

# ---------------------------------------------------------------- counting the cases tried


def counted(test: Callable[..., None]) -> Callable[..., None]:
    """Count each call of a property test's body (every generated case, shrinking included)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        case_counts.count("hypothesis cases tried", test.__name__)
        test(*args, **kwargs)

    return run


# no example database, so a run never depends on earlier ones; too_slow would only flag a busy machine
PROPERTY = settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- strategies

DTYPES = st.sampled_from([torch.float32, torch.float64])


def floats(low: float, high: float) -> st.SearchStrategy[float]:
    # no subnormals: the test session flushes them to zero (tests/conftest.py)
    return st.floats(low, high, allow_nan=False, allow_infinity=False, allow_subnormal=False)


FINITE = floats(-1e3, 1e3)
LOGPROBS = floats(-100.0, 0.0)
GARBAGE = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30]) | FINITE
QUARTERS = st.integers(-8, 8).map(lambda k: k / 4)
# tenths: the mean of equal tenths is often off by an ulp, which whitening must not blow up
EQUAL = st.integers(-10_000, 10_000).map(lambda k: k / 10) | FINITE
SHIFTS = st.integers(-1000, 1000).map(lambda k: k / 4)


def draw_tensor(data: st.DataObject, shape: tuple[int, ...], elements: st.SearchStrategy, dtype: torch.dtype):
    count = math.prod(shape)
    return torch.tensor(data.draw(st.lists(elements, min_size=count, max_size=count)), dtype=dtype).view(shape)


def draw_elements(data: st.DataObject) -> st.SearchStrategy[float]:
    """Elements for one case: independent values, tiny ones (whose squares underflow), or one or
    two levels, so that ties and tensors of equal values (a kink of the std) come up often."""
    kind = data.draw(st.sampled_from(["independent", "tiny", "levels"]))
    if kind == "independent":
        return FINITE | QUARTERS
    if kind == "tiny":
        return floats(-1e-20, 1e-20)
    return st.sampled_from(data.draw(st.lists(EQUAL, min_size=1, max_size=2)))


def draw_shape(data: st.DataObject, max_batch: int = 4, max_seq: int = 6) -> tuple[int, int]:
    return data.draw(st.integers(1, max_batch)), data.draw(st.integers(1, max_seq))


def draw_mask(data: st.DataObject, shape: tuple[int, int]) -> torch.Tensor:
    """Any 0/1 pattern (all-masked rows and all-masked batches included), as bool, int or float."""
    bits = draw_tensor(data, shape, st.booleans(), torch.bool)
    return bits.to(data.draw(st.sampled_from([torch.bool, torch.int64, torch.float32])))


def draw_group_ids(data: st.DataObject, batch: int) -> torch.Tensor:
    """Groups in any order and of any size, groups of one included."""
    return torch.tensor(data.draw(st.lists(st.integers(0, batch - 1), min_size=batch, max_size=batch)))


def draw_groups(data: st.DataObject, batch: int, exact: bool = False) -> dict[str, Any]:
    """``group_ids`` (any order and size, groups of one included) or a power-of-two ``group_size``.

    Group means of quarters are exact for power-of-two sizes only, so ``exact`` claims use those.
    """
    if not exact and data.draw(st.booleans()):
        return {"group_ids": draw_group_ids(data, batch)}
    return {"group_size": data.draw(st.sampled_from([size for size in (1, 2, 4, 8) if batch % size == 0]))}


def with_garbage(data: st.DataObject, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` with drawn garbage at the positions where ``mask`` (a prefix of its shape) is 0."""
    keep = mask.bool().reshape(mask.shape + (1,) * (values.dim() - mask.dim())).expand_as(values)
    elements = st.integers(-5, 50) if not values.is_floating_point() else GARBAGE
    return torch.where(keep, values, draw_tensor(data, tuple(values.shape), elements, values.dtype))


# ---------------------------------------------------------------- checks on nested results


def tensors_in(result: Any) -> list[torch.Tensor]:
    """The tensors of a result: a tensor, or tuples / dicts of them (metrics), in a fixed order."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, dict):
        return [t for key in sorted(result) for t in tensors_in(result[key])]
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in tensors_in(item)]
    return []


def assert_finite(result: Any) -> None:
    for tensor in tensors_in(result):
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), tensor


def assert_identical(first: Any, second: Any) -> None:
    pairs = list(zip(tensors_in(first), tensors_in(second), strict=True))
    for a, b in pairs:
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


def loss_of(result: Any) -> torch.Tensor:
    """A scalar to backpropagate: the sum of the result's differentiable tensors, each weighted by
    position so that no gradient cancels (the entries of a whitened tensor sum to 0)."""
    total = torch.zeros((), dtype=torch.float64)
    for tensor in tensors_in(result):
        if tensor.requires_grad:
            weights = torch.arange(1, tensor.numel() + 1, dtype=tensor.dtype).view(tensor.shape) / tensor.numel()
            total = total + (tensor * weights).sum()
    return total


def check_masked_invariance(
    data: st.DataObject,
    compute: Callable[..., Any],
    token_inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
    differentiable: tuple[str, ...] = (),
) -> Any:
    """``compute(**token_inputs)`` as drawn and with garbage at masked positions of every input.

    Both results are finite and identical; the gradients with respect to ``differentiable``
    inputs are finite, identical and 0 at masked positions. Returns the first result.
    """
    outcomes = []
    for inputs in (token_inputs, {name: with_garbage(data, t, mask) for name, t in token_inputs.items()}):
        leaves = {name: t.clone().requires_grad_(name in differentiable) for name, t in inputs.items()}
        result = compute(**leaves)
        assert_finite(result)
        gradients = []
        if differentiable:
            loss = loss_of(result)
            assert loss.requires_grad, "nothing in the result depends on the differentiable inputs"
            grads = torch.autograd.grad(loss, [leaves[n] for n in differentiable], allow_unused=True)
            for name, grad in zip(differentiable, grads, strict=True):
                grad = torch.zeros_like(leaves[name]) if grad is None else grad
                assert torch.isfinite(grad).all(), (name, grad)
                masked = ~mask.bool().reshape(mask.shape + (1,) * (grad.dim() - mask.dim())).expand_as(grad)
                assert grad[masked].abs().sum().item() == 0.0, (name, grad)
                gradients.append(grad)
        outcomes.append((tensors_in(result), gradients))
    detached = [([t.detach() for t in result], grads) for result, grads in outcomes]
    assert_identical(detached[0], detached[1])
    return outcomes[0][0]


# ---------------------------------------------------------------- masked statistics


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_masked_statistics_are_finite_and_ignore_masked_values(data):
    shape, dtype = draw_shape(data), data.draw(DTYPES)
    values = draw_tensor(data, shape, draw_elements(data), dtype)
    mask = draw_mask(data, shape)
    unbiased, dim = data.draw(st.booleans()), data.draw(st.sampled_from([None, -1]))

    def statistics(values):
        return (
            alg.masked_sum(values, mask, dim=dim),
            alg.masked_mean(values, mask, dim=dim),
            alg.masked_var(values, mask, unbiased=unbiased, dim=dim),
            alg.masked_std(values, mask, unbiased=unbiased, dim=dim),
            # (inf, -inf) when nothing is counted, by definition
            alg.masked_min_max(values, mask) if dim is None and mask.bool().any() else (),
        )

    check_masked_invariance(data, statistics, {"values": values}, mask, ("values",))


@settings(PROPERTY, max_examples=80)
@given(data=st.data())
@counted
def test_whitening_is_finite_and_ignores_masked_values(data):
    shape, dtype = draw_shape(data), data.draw(DTYPES)
    values = draw_tensor(data, shape, draw_elements(data), dtype)
    mask = draw_mask(data, shape)
    shift_mean, unbiased = data.draw(st.booleans()), data.draw(st.booleans())
    eps = data.draw(st.sampled_from([0.0, 1e-8, 1e-3]))
    whitened, *_ = check_masked_invariance(
        data,
        lambda values: alg.masked_whiten(values, mask, shift_mean=shift_mean, eps=eps, unbiased=unbiased),
        {"values": values},
        mask,
        ("values",),
    )
    assert whitened[~mask.bool()].abs().sum().item() == 0.0


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_whitening_is_invariant_to_a_shift(data):
    shape = draw_shape(data)
    values = draw_tensor(data, shape, QUARTERS, torch.float64)
    mask, shift = draw_mask(data, shape), data.draw(SHIFTS)
    unbiased = data.draw(st.booleans())
    whitened = alg.masked_whiten(values, mask, unbiased=unbiased)
    shifted = alg.masked_whiten(values + shift, mask, unbiased=unbiased)
    assert torch.allclose(shifted, whitened, rtol=0, atol=1e-9), (whitened, shifted)


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_whitening_equal_values_gives_zero_or_the_values(data):
    shape, dtype = draw_shape(data), data.draw(DTYPES)
    constant = data.draw(EQUAL)
    mask = draw_mask(data, shape)
    values = with_garbage(data, torch.full(shape, constant, dtype=dtype), mask)
    counted_values = torch.where(mask.bool(), torch.full(shape, constant, dtype=dtype), 0)
    assert alg.masked_whiten(values, mask).abs().sum().item() == 0.0
    assert torch.equal(alg.masked_whiten(values, mask, shift_mean=False), counted_values)


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_whitened_values_have_zero_mean_and_unit_std(data):
    shape = draw_shape(data, max_batch=4, max_seq=6)
    values = draw_tensor(data, shape, FINITE, torch.float64)
    mask = draw_mask(data, shape)
    kept = values[mask.bool()].tolist()
    whitened = alg.masked_whiten(values, mask, eps=0.0)[mask.bool()].tolist()
    if len(kept) < 2 or max(kept) - min(kept) < 1e-3 * (1 + max(abs(k) for k in kept)):
        return  # spread below the accuracy claimed here; equal values have their own property
    mean = sum(whitened) / len(whitened)
    variance = sum((w - mean) ** 2 for w in whitened) / (len(whitened) - 1)
    assert mean == pytest.approx(0.0, abs=1e-9)
    assert variance == pytest.approx(1.0, rel=1e-9)


# ---------------------------------------------------------------- advantage estimators


def estimator_inputs(
    data: st.DataObject,
    name: str,
    batch: int,
    mask: torch.Tensor,
    dtype: torch.dtype,
    elements: st.SearchStrategy,
    exact: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
    """``(outcome rewards [batch], per-token inputs, other keyword arguments)`` for the named estimator."""
    metadata = alg.ADVANTAGE_ESTIMATORS.metadata(name)
    shape = tuple(mask.shape)
    outcome = draw_tensor(data, (batch,), elements, dtype)
    token_inputs: dict[str, torch.Tensor] = {}
    options: dict[str, Any] = {}
    if metadata.get("needs_values"):
        token_inputs["values"] = draw_tensor(data, shape, elements, dtype)
    if metadata.get("needs_groups"):
        options.update(draw_groups(data, batch, exact))
    if metadata.get("takes_token_kl") and data.draw(st.booleans()):
        token_inputs["token_kl"] = draw_tensor(data, shape, elements, dtype)
        options["kl_coef"] = data.draw(st.sampled_from([0.0, 0.5, 2.0]))  # dyadic: exact on the quarter grid
    return outcome, token_inputs, options


@settings(PROPERTY, max_examples=60)
@given(data=st.data(), name=st.sampled_from(alg.ADVANTAGE_ESTIMATORS.names()))
@counted
def test_advantage_estimators_are_finite_and_ignore_masked_values(data, name):
    (batch, seq), dtype = draw_shape(data), data.draw(DTYPES)
    mask = draw_mask(data, (batch, seq))
    elements = draw_elements(data)
    outcome, token_inputs, options = estimator_inputs(data, name, batch, mask, dtype, elements)
    if "gamma" in alg.ADVANTAGE_ESTIMATORS.metadata(name).get("options", ()):
        options["gamma"] = data.draw(st.sampled_from([1.0, 0.9, 0.0]))
    estimator = alg.ADVANTAGE_ESTIMATORS.get(name)
    if data.draw(st.booleans()):  # per-token rewards, masked garbage included
        token_inputs["rewards"] = draw_tensor(data, (batch, seq), elements, dtype)
        compute = functools.partial(estimator, mask=mask, **options)
    else:
        compute = functools.partial(estimator, outcome, mask, **options)
    advantages, returns = check_masked_invariance(data, compute, token_inputs, mask, tuple(token_inputs))
    assert advantages[~mask.bool()].abs().sum().item() == 0.0
    assert returns[~mask.bool()].abs().sum().item() == 0.0


@settings(PROPERTY, max_examples=40)
@given(data=st.data(), name=st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"]))
@counted
def test_group_estimators_give_finite_gradients_in_the_rewards(data, name):
    # the std of a flat group is a kink; its gradient must be 0 there, never NaN
    (batch, seq) = draw_shape(data)
    rewards = draw_tensor(data, (batch,), draw_elements(data), torch.float64).requires_grad_(True)
    mask = draw_mask(data, (batch, seq))
    advantages, _ = alg.ADVANTAGE_ESTIMATORS.get(name)(rewards, mask, group_ids=draw_group_ids(data, batch))
    (gradient,) = torch.autograd.grad(loss_of(advantages), rewards, allow_unused=True)
    assert gradient is None or torch.isfinite(gradient).all(), gradient


def shift_invariant_options(data: st.DataObject, name: str) -> dict[str, Any]:
    """Options under which adding a constant to every outcome reward shifts every counted return equally."""
    if name in ("gae", "reinforce_plus_plus"):
        return {"gamma": 1.0, **({"lam": 1.0} if name == "gae" else {})}
    if name == "grpo":
        return {"normalize_std": data.draw(st.booleans())}
    if name == "reinforce_plus_plus_baseline":
        return {"subtract_batch_mean": data.draw(st.booleans()), "gamma": data.draw(st.sampled_from([1.0, 0.5]))}
    return {}


SHIFT_INVARIANT = ["gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]


@settings(PROPERTY, max_examples=60)
@given(data=st.data(), name=st.sampled_from(SHIFT_INVARIANT))
@counted
def test_advantages_are_invariant_to_a_reward_shift(data, name):
    (batch, seq) = draw_shape(data, max_batch=8)
    mask = draw_mask(data, (batch, seq))
    outcome, token_inputs, options = estimator_inputs(data, name, batch, mask, torch.float64, QUARTERS, exact=True)
    options.update(shift_invariant_options(data, name), **token_inputs)
    shift = data.draw(SHIFTS)
    estimator = alg.ADVANTAGE_ESTIMATORS.get(name)
    advantages, _ = estimator(outcome, mask, **options)
    shifted, _ = estimator(outcome + shift, mask, **options)
    assert torch.allclose(shifted, advantages, rtol=0, atol=1e-9), (advantages, shifted)


@settings(PROPERTY, max_examples=60)
@given(data=st.data(), name=st.sampled_from(SHIFT_INVARIANT))
@counted
def test_equal_rewards_give_exactly_zero_advantage(data, name):
    (batch, seq), dtype = draw_shape(data, max_batch=8, max_seq=8), data.draw(DTYPES)
    mask = draw_mask(data, (batch, seq))
    reward = data.draw(EQUAL)
    options: dict[str, Any] = shift_invariant_options(data, name)
    if name == "gae":
        options["values"] = torch.zeros(batch, seq, dtype=dtype)  # A_t = reward on every counted token
    if alg.ADVANTAGE_ESTIMATORS.metadata(name).get("needs_groups"):
        options["group_ids"] = draw_group_ids(data, batch)
    advantages, _ = alg.ADVANTAGE_ESTIMATORS.get(name)(torch.full((batch,), reward, dtype=dtype), mask, **options)
    assert advantages.abs().sum().item() == 0.0, advantages


@settings(PROPERTY, max_examples=40)
@given(data=st.data(), name=st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"]))
@counted
def test_group_advantage_is_zero_exactly_at_the_group_mean(data, name):
    (batch, seq) = draw_shape(data)
    rewards = draw_tensor(data, (batch,), QUARTERS, torch.float64)
    ids = draw_group_ids(data, batch)
    mask = torch.ones(batch, seq)
    options = {"subtract_batch_mean": False} if name == "reinforce_plus_plus_baseline" else {}
    advantages, _ = alg.ADVANTAGE_ESTIMATORS.get(name)(rewards, mask, group_ids=ids, **options)
    for i in range(batch):
        group = [rewards[j].item() for j in range(batch) if ids[j] == ids[i]]
        # 0 for every sample of a flat group (and of a group of one), non-zero off the group's mean
        off_mean = rewards[i].item() != sum(group) / len(group)
        assert (advantages[i].abs().sum().item() != 0.0) == off_mean, (group, advantages[i])


# ---------------------------------------------------------------- policy, value and entropy losses


def draw_scale(data: st.DataObject, seq: int) -> LossScale | None:
    if not data.draw(st.booleans()):
        return None
    size = st.none() | floats(0.0, 100.0)
    return LossScale(data.draw(size), data.draw(size), data.draw(st.integers(1, 4)), seq)


def draw_aggregation(data: st.DataObject, seq: int) -> tuple[str, LossScale | None]:
    mode = data.draw(st.sampled_from(alg.LOSS_AGGREGATIONS.names()))
    scale = draw_scale(data, seq)
    if mode == "constant_normalizer" and scale is None:
        scale = LossScale(max_response_length=seq)
    return mode, scale


@settings(PROPERTY, max_examples=60)
@given(data=st.data(), name=st.sampled_from(alg.POLICY_LOSSES.names()))
@counted
def test_policy_losses_are_finite_and_ignore_masked_values(data, name):
    (batch, seq), dtype = draw_shape(data), data.draw(DTYPES)
    mask = draw_mask(data, (batch, seq))
    aggregation, scale = draw_aggregation(data, seq)
    options: dict[str, Any] = {"aggregation": aggregation, "scale": scale}
    if name == "ppo":
        options["dual_clip_c"] = data.draw(st.sampled_from([None, 3.0]))
        options["clip_eps_high"] = data.draw(st.sampled_from([None, 0.28]))
    token_inputs = {
        "logprobs": draw_tensor(data, (batch, seq), LOGPROBS, dtype),
        "old_logprobs": draw_tensor(data, (batch, seq), LOGPROBS, dtype),
        "advantages": draw_tensor(data, (batch, seq), FINITE, dtype),
    }
    if data.draw(st.booleans()):
        token_inputs["token_weights"] = draw_tensor(data, (batch, seq), floats(0.0, 10.0), dtype)
    loss = alg.POLICY_LOSSES.get(name)
    check_masked_invariance(data, lambda **t: loss(mask=mask, **t, **options), token_inputs, mask, ("logprobs",))


@settings(PROPERTY, max_examples=30)
@given(data=st.data(), name=st.sampled_from(alg.POLICY_LOSSES.names()))
@counted
def test_policy_losses_vanish_without_advantage(data, name):
    (batch, seq) = draw_shape(data)
    mask = draw_mask(data, (batch, seq))
    aggregation, scale = draw_aggregation(data, seq)
    logprobs = draw_tensor(data, (batch, seq), LOGPROBS, torch.float64).requires_grad_(True)
    old = draw_tensor(data, (batch, seq), LOGPROBS, torch.float64)
    loss, _ = alg.POLICY_LOSSES.get(name)(
        logprobs, old, torch.zeros(batch, seq, dtype=torch.float64), mask, aggregation=aggregation, scale=scale
    )
    (gradient,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() == 0.0 and gradient.abs().sum().item() == 0.0


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_value_loss_is_finite_and_ignores_masked_values(data):
    (batch, seq), dtype = draw_shape(data), data.draw(DTYPES)
    mask = draw_mask(data, (batch, seq))
    aggregation, scale = draw_aggregation(data, seq)
    clip_eps = data.draw(st.sampled_from([None, 0.2, 10.0]))
    token_inputs = {key: draw_tensor(data, (batch, seq), FINITE, dtype) for key in ("values", "old_values", "returns")}
    check_masked_invariance(
        data,
        lambda **t: alg.compute_value_loss(mask=mask, clip_eps=clip_eps, aggregation=aggregation, scale=scale, **t),
        token_inputs,
        mask,
        ("values",),
    )


@settings(PROPERTY, max_examples=30)
@given(data=st.data())
@counted
def test_entropy_is_finite_bounded_and_its_bonus_ignores_masked_values(data):
    (batch, seq), dtype = draw_shape(data), data.draw(DTYPES)
    vocab = data.draw(st.integers(1, 5))
    logits = draw_tensor(data, (batch, seq, vocab), FINITE, dtype)
    entropy = entropy_from_logits(logits)
    assert torch.isfinite(entropy).all()
    assert (entropy >= -1e-6).all() and (entropy <= math.log(vocab) + 1e-5).all(), entropy
    mask = draw_mask(data, (batch, seq))
    aggregation, scale = draw_aggregation(data, seq)
    check_masked_invariance(
        data,
        lambda entropy: alg.compute_entropy_bonus(entropy, mask, 0.01, aggregation=aggregation, scale=scale),
        {"entropy": entropy},
        mask,
        ("entropy",),
    )


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_aggregations_are_finite_and_ignore_masked_values(data):
    (batch, seq), dtype = draw_shape(data), data.draw(DTYPES)
    mask = draw_mask(data, (batch, seq))
    mode, scale = draw_aggregation(data, seq)
    check_masked_invariance(
        data,
        lambda token_losses: alg.aggregate_loss(token_losses, mask, mode, scale),
        {"token_losses": draw_tensor(data, (batch, seq), FINITE, dtype)},
        mask,
        ("token_losses",),
    )


# ---------------------------------------------------------------- KL estimators and off-policy corrections


@settings(PROPERTY, max_examples=50)
@given(data=st.data(), estimator=st.sampled_from(alg.KL_ESTIMATORS.names()))
@counted
def test_kl_is_finite_and_ignores_masked_values(data, estimator):
    (batch, seq), dtype = draw_shape(data), data.draw(DTYPES)
    mask = draw_mask(data, (batch, seq))
    aggregation, scale = draw_aggregation(data, seq)
    token_inputs = {key: draw_tensor(data, (batch, seq), LOGPROBS, dtype) for key in ("logprobs", "ref_logprobs")}
    check_masked_invariance(
        data,
        lambda logprobs, ref_logprobs: alg.compute_kl_loss(logprobs, ref_logprobs, mask, estimator, aggregation, scale),
        token_inputs,
        mask,
        ("logprobs",),
    )
    check_masked_invariance(
        data, lambda **t: alg.kl_reward_penalty(mask=mask, kl_coef=0.1, estimator=estimator, **t), token_inputs, mask
    )


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_k3_with_default_clamps_is_bounded_in_value_and_gradient(data):
    (batch, seq), dtype = draw_shape(data), data.draw(DTYPES)
    log_ratio = draw_tensor(data, (batch, seq), floats(-50.0, 50.0), dtype).requires_grad_(True)
    kl = alg.compute_token_kl(log_ratio, torch.zeros(batch, seq, dtype=dtype), torch.ones(batch, seq), "k3")
    (gradient,) = torch.autograd.grad(kl.sum(), log_ratio)
    # k3 >= 0, clamped at 10; it is below 10 only for -2.62 < d < 11.01, where |1 - e^-d| < e^2.62 - 1 < 13
    assert (kl >= 0).all() and (kl <= 10).all(), kl
    assert (gradient.abs() < 13).all(), gradient


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_k1_and_k2_are_bounded_by_the_log_ratio_clamp_only(data):
    (batch, seq) = draw_shape(data)
    d = draw_tensor(data, (batch, seq), floats(-50.0, 50.0), torch.float64)
    clamped = d.clamp(-20.0, 20.0)
    zeros, ones = torch.zeros(batch, seq, dtype=torch.float64), torch.ones(batch, seq)
    assert torch.equal(alg.compute_token_kl(d, zeros, ones, "k1"), clamped)
    assert torch.allclose(alg.compute_token_kl(d, zeros, ones, "k2"), clamped**2 / 2, rtol=1e-15, atol=0)


@settings(PROPERTY, max_examples=50)
@given(data=st.data(), name=st.sampled_from(alg.OFF_POLICY_CORRECTIONS.names()), level=st.sampled_from(LEVELS))
@counted
def test_off_policy_corrections_are_finite_and_ignore_masked_values(data, name, level):
    (batch, seq), dtype = draw_shape(data), data.draw(DTYPES)
    mask = draw_mask(data, (batch, seq))
    token_inputs = {
        key: draw_tensor(data, (batch, seq), LOGPROBS, dtype) for key in ("old_logprobs", "rollout_logprobs")
    }
    correct = alg.OFF_POLICY_CORRECTIONS.get(name)
    output, *_ = check_masked_invariance(data, lambda **t: correct(mask=mask, level=level, **t), token_inputs, mask)
    assert not output[~mask.bool()].to(torch.float64).abs().sum().item()


# ---------------------------------------------------------------- distillation and reward-model losses


@settings(PROPERTY, max_examples=40)
@given(data=st.data(), name=st.sampled_from(alg.DISTILLATION_LOSSES.names()))
@counted
def test_distillation_losses_are_finite_and_ignore_masked_values(data, name):
    (batch, seq), dtype = draw_shape(data), data.draw(DTYPES)
    vocab = data.draw(st.integers(1, 5))
    mask = draw_mask(data, (batch, seq))
    options: dict[str, Any] = {"temperature": data.draw(st.sampled_from([0.5, 1.0, 2.0]))}
    if name == "generalized_jsd":
        options["beta"] = data.draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    token_inputs = {
        key: draw_tensor(data, (batch, seq, vocab), FINITE, dtype) for key in ("student_logits", "teacher_logits")
    }
    loss = alg.DISTILLATION_LOSSES.get(name)
    check_masked_invariance(data, lambda **t: loss(mask=mask, **t, **options), token_inputs, mask, ("student_logits",))


@settings(PROPERTY, max_examples=40)
@given(data=st.data(), soft=st.booleans())
@counted
def test_process_reward_loss_is_finite_and_ignores_masked_steps(data, soft):
    (batch, seq), dtype = draw_shape(data), data.draw(DTYPES)
    classes = 2 if soft else data.draw(st.integers(2, 4))
    step_mask = draw_mask(data, (batch, seq))
    labels = (
        draw_tensor(data, (batch, seq), floats(0.0, 1.0), dtype)
        if soft
        else draw_tensor(data, (batch, seq), st.integers(0, classes - 1), torch.int64)
    )
    token_inputs = {"logits": draw_tensor(data, (batch, seq, classes), FINITE, dtype), "labels": labels}
    check_masked_invariance(
        data, lambda **t: alg.process_reward_loss(step_mask=step_mask, **t), token_inputs, step_mask, ("logits",)
    )


@settings(PROPERTY, max_examples=30)
@given(data=st.data(), name=st.sampled_from(["bradley_terry", "log_exp"]))
@counted
def test_pairwise_reward_model_losses_are_finite(data, name):
    batch = data.draw(st.integers(1, 6))
    chosen = draw_tensor(data, (batch,), FINITE, torch.float64).requires_grad_(True)
    rejected = draw_tensor(data, (batch,), FINITE, torch.float64)
    loss, metrics = alg.REWARD_MODEL_LOSSES.get(name)(chosen, rejected, margin=data.draw(st.sampled_from([None, 0.5])))
    (gradient,) = torch.autograd.grad(loss, chosen)
    assert_finite((loss, metrics, gradient))


# ---------------------------------------------------------------- preference losses


def draw_preference_inputs(data: st.DataObject, name: str, batch: int) -> dict[str, torch.Tensor]:
    """Summed log-probs (with lengths where the loss takes them) of ``batch`` pairs, or unpaired KTO examples."""
    logps = functools.partial(draw_tensor, data, (batch,), floats(-1e3, 0.0), torch.float64)
    lengths = functools.partial(draw_tensor, data, (batch,), st.integers(0, 50), torch.int64)
    if name == "kto":
        desirable = draw_tensor(data, (batch,), st.booleans(), torch.bool)
        inputs = {"policy_logps": logps(), "ref_logps": logps(), "desirable": desirable}
        if data.draw(st.booleans()):
            inputs.update(policy_kl_logps=logps(), ref_kl_logps=logps())
        return inputs
    inputs = {"policy_chosen_logps": logps(), "policy_rejected_logps": logps()}
    if alg.PREFERENCE_LOSSES.metadata(name).get("uses_reference"):
        inputs.update(ref_chosen_logps=logps(), ref_rejected_logps=logps())
    if name == "dpo_nll" or (name in ("ipo", "simpo", "orpo") and data.draw(st.booleans())):
        inputs["chosen_lengths"] = lengths()
        if name != "dpo_nll":
            inputs["rejected_lengths"] = lengths()
    return inputs


@settings(PROPERTY, max_examples=60)
@given(data=st.data(), name=st.sampled_from(alg.PREFERENCE_LOSSES.names()))
@counted
def test_preference_losses_are_finite_with_finite_gradients(data, name):
    inputs = draw_preference_inputs(data, name, data.draw(st.integers(1, 6)))
    policy = "policy_logps" if name == "kto" else "policy_chosen_logps"
    inputs[policy].requires_grad_(True)
    loss, metrics = alg.PREFERENCE_LOSSES.get(name)(**inputs)
    (gradient,) = torch.autograd.grad(loss, inputs[policy])
    assert_finite((loss, metrics, gradient))


# losses that are a plain mean over pairs (KTO's batch KL and ORPO's token-mean NLL are batch-level)
PER_PAIR = ["dpo", "cdpo", "ipo", "dpo_nll", "simpo"]


@settings(PROPERTY, max_examples=40)
@given(data=st.data(), name=st.sampled_from(PER_PAIR))
@counted
def test_a_pair_never_changes_another_pairs_loss(data, name):
    # the sequence-level analogue of masked invariance: the batch loss is the mean of each pair's own loss
    batch = data.draw(st.integers(2, 5))
    inputs = draw_preference_inputs(data, name, batch)
    loss = alg.PREFERENCE_LOSSES.get(name)
    alone = [loss(**{key: t[i : i + 1] for key, t in inputs.items()})[0].item() for i in range(batch)]
    assert loss(**inputs)[0].item() == pytest.approx(sum(alone) / batch, rel=1e-12, abs=1e-12)


# ---------------------------------------------------------------- reward shaping


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_running_normalizer_is_invariant_to_a_shift_and_zero_on_equal_rewards(data):
    batches = data.draw(st.lists(st.lists(QUARTERS, min_size=1, max_size=5), min_size=1, max_size=3))
    shift = data.draw(SHIFTS)
    plain, shifted = alg.RunningRewardNormalizer(), alg.RunningRewardNormalizer()
    for rewards in batches:
        rewards = torch.tensor(rewards, dtype=torch.float64)
        out, out_shifted = plain(rewards), shifted(rewards + shift)
        assert torch.isfinite(out).all()
        assert torch.allclose(out_shifted, out, rtol=0, atol=1e-6), (out, out_shifted)
    if len({r for rewards in batches for r in rewards}) == 1:
        assert out.abs().sum().item() == 0.0 and out_shifted.abs().sum().item() == 0.0


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_running_normalizer_of_equal_rewards_is_exactly_zero_or_unscaled(data):
    dtype, reward = data.draw(DTYPES), data.draw(EQUAL)
    counts = data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
    centring, scaling = alg.RunningRewardNormalizer(), alg.RunningRewardNormalizer(shift_mean=False)
    for count in counts:
        rewards = torch.full((count,), reward, dtype=dtype)
        assert centring(rewards).abs().sum().item() == 0.0
        assert torch.equal(scaling(rewards), rewards)  # no spread seen: no scale to divide by


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
@counted
def test_group_shaping_treats_flat_groups_as_without_signal(data):
    batch = data.draw(st.integers(1, 6))
    rewards = draw_tensor(data, (batch,), QUARTERS, torch.float64)
    lengths = draw_tensor(data, (batch,), st.integers(1, 4), torch.int64)
    ids = draw_group_ids(data, batch)
    keep = alg.filter_zero_variance_groups(rewards, group_ids=ids).keep
    penalty = alg.kimi_length_penalty(lengths, rewards > 0, group_ids=ids)
    assert torch.isfinite(penalty).all()
    for i in range(batch):
        group = [j for j in range(batch) if ids[j] == ids[i]]
        assert keep[i].item() == (len({rewards[j].item() for j in group}) > 1)
        if len({lengths[j].item() for j in group}) == 1:
            assert penalty[i].item() == 0.0
