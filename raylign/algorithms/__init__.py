"""Pure tensor algorithms for post-training, each registered by name.

Conventions: per-token tensors are ``[batch, seq]`` with a ``mask`` of the same shape
(1 = response token that counts); sequence tensors are ``[batch]``; group estimators take
``group_size`` (consecutive groups) or ``group_ids``; losses return ``(loss, metrics)`` with
detached metrics. Select an implementation from a config string with the registries, e.g.
``ADVANTAGE_ESTIMATORS.get("grpo")``.
"""

from raylign.algorithms.advantages import (
    compute_dr_grpo_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_rloo_advantages,
    discounted_returns,
    last_token_positions,
    sequence_rewards,
    token_rewards,
)
from raylign.algorithms.aggregation import (
    LossScale,
    aggregate_constant_normalizer,
    aggregate_loss,
    aggregate_seq_mean_token_mean,
    aggregate_seq_mean_token_sum,
    aggregate_token_mean,
    compute_loss_scale,
)
from raylign.algorithms.distillation import forward_kl_loss, generalized_jsd_loss, reverse_kl_loss
from raylign.algorithms.groups import GroupStats, group_stats, resolve_group_ids
from raylign.algorithms.kl import compute_kl_loss, compute_token_kl, kl_k1, kl_k2, kl_k3, kl_reward_penalty
from raylign.algorithms.off_policy import (
    importance_log_ratio,
    importance_ratio_sums,
    mask_by_importance_ratio,
    truncated_importance_weights,
)
from raylign.algorithms.policy_loss import (
    compute_entropy_bonus,
    compute_gspo_policy_loss,
    compute_ppo_policy_loss,
)
from raylign.algorithms.preference import (
    conservative_dpo_loss,
    dpo_loss,
    dpo_nll_loss,
    ipo_loss,
    kto_loss,
    orpo_loss,
    simpo_loss,
)
from raylign.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    DISTILLATION_LOSSES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    REWARD_MODEL_LOSSES,
    REWARD_SHAPERS,
    SAMPLE_FILTERS,
    VALUE_LOSSES,
    Registry,
)
from raylign.algorithms.reward_model import (
    bradley_terry_loss,
    log_exp_loss,
    process_reward_loss,
    step_separator_mask,
)
from raylign.algorithms.reward_shaping import (
    GroupFilterResult,
    RunningRewardNormalizer,
    clip_rewards,
    dapo_overlong_penalty,
    filter_zero_variance_groups,
    kimi_length_penalty,
    linear_length_penalty,
)
from raylign.algorithms.stats import (
    masked_count,
    masked_mean,
    masked_min_max,
    masked_std,
    masked_sum,
    masked_var,
    masked_whiten,
)
from raylign.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DISTILLATION_LOSSES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "REWARD_MODEL_LOSSES",
    "REWARD_SHAPERS",
    "SAMPLE_FILTERS",
    "VALUE_LOSSES",
    "GroupFilterResult",
    "GroupStats",
    "LossScale",
    "Registry",
    "RunningRewardNormalizer",
    "aggregate_constant_normalizer",
    "aggregate_loss",
    "aggregate_seq_mean_token_mean",
    "aggregate_seq_mean_token_sum",
    "aggregate_token_mean",
    "bradley_terry_loss",
    "clip_rewards",
    "compute_dr_grpo_advantages",
    "compute_entropy_bonus",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_gspo_policy_loss",
    "compute_kl_loss",
    "compute_loss_scale",
    "compute_ppo_policy_loss",
    "compute_reinforce_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_rloo_advantages",
    "compute_token_kl",
    "compute_value_loss",
    "conservative_dpo_loss",
    "dapo_overlong_penalty",
    "discounted_returns",
    "dpo_loss",
    "dpo_nll_loss",
    "filter_zero_variance_groups",
    "forward_kl_loss",
    "generalized_jsd_loss",
    "group_stats",
    "importance_log_ratio",
    "importance_ratio_sums",
    "ipo_loss",
    "kimi_length_penalty",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_reward_penalty",
    "kto_loss",
    "last_token_positions",
    "linear_length_penalty",
    "log_exp_loss",
    "mask_by_importance_ratio",
    "masked_count",
    "masked_mean",
    "masked_min_max",
    "masked_std",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "orpo_loss",
    "process_reward_loss",
    "resolve_group_ids",
    "reverse_kl_loss",
    "sequence_rewards",
    "simpo_loss",
    "step_separator_mask",
    "token_rewards",
    "truncated_importance_weights",
]
