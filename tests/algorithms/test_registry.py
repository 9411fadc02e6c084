"""The registry selects algorithms by config string and fails loudly on unknown names."""

from __future__ import annotations

import pytest

import raylign.algorithms as alg
from raylign.algorithms.registry import Registry


def test_register_then_get_returns_the_function():
    registry = Registry("widget")

    @registry.register("double", cheap=True)
    def double(x):
        return 2 * x

    assert registry.get("double") is double
    assert registry.get("double")(3) == 6
    assert registry.metadata("double") == {"cheap": True}
    assert "double" in registry and "triple" not in registry


def test_unknown_name_raises_key_error_listing_registered_names():
    registry = Registry("widget")
    registry.register("b")(lambda: None)
    registry.register("a")(lambda: None)
    with pytest.raises(KeyError, match=r"unknown widget 'c'; registered: a, b"):
        registry.get("c")


def test_registering_a_name_twice_fails():
    registry = Registry("widget")
    registry.register("a")(lambda: None)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(lambda: None)


@pytest.mark.parametrize(
    ("registry", "names"),
    [
        (alg.KL_ESTIMATORS, {"k1", "k2", "k3"}),
        (
            alg.ADVANTAGE_ESTIMATORS,
            {"gae", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "grpo", "dr_grpo"},
        ),
        (alg.POLICY_LOSSES, {"ppo", "gspo"}),
        (alg.VALUE_LOSSES, {"ppo_clipped"}),
        (alg.OFF_POLICY_CORRECTIONS, {"truncated_is", "ratio_mask"}),
        (alg.LOSS_AGGREGATIONS, {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_normalizer"}),
        (alg.REWARD_SHAPERS, {"clip", "dapo_overlong", "linear_length", "kimi_length"}),
        (alg.SAMPLE_FILTERS, {"nonzero_reward_variance"}),
        (alg.PREFERENCE_LOSSES, {"dpo", "cdpo", "ipo", "dpo_nll", "simpo", "orpo", "kto"}),
        (alg.REWARD_MODEL_LOSSES, {"bradley_terry", "log_exp", "process_reward"}),
        (alg.DISTILLATION_LOSSES, {"forward_kl", "reverse_kl", "generalized_jsd"}),
    ],
)
def test_every_deliverable_is_selectable_by_name(registry, names):
    assert set(registry.names()) == names
    for name in names:
        assert callable(registry.get(name))
        assert registry.get(name).__doc__, f"{registry.kind} {name} needs a docstring with formula and paper"


def test_metadata_tells_which_estimators_need_a_critic_or_groups():
    assert alg.ADVANTAGE_ESTIMATORS.metadata("gae") == {
        "needs_values": True,
        "options": ("gamma", "lam"),
        "takes_token_kl": True,
    }
    assert alg.ADVANTAGE_ESTIMATORS.metadata("grpo") == {"needs_groups": True, "options": ("normalize_std",)}
    assert alg.ADVANTAGE_ESTIMATORS.metadata("reinforce") == {"options": ("gamma",), "takes_token_kl": True}
    assert alg.ADVANTAGE_ESTIMATORS.metadata("rloo") == {"needs_groups": True}
