"""Vetted defaults per algorithm; the user's YAML and command line override any of them.

Each preset sets only the ``algorithm`` section (and ``sampling.n`` where the estimator
compares samples of a prompt). References: PPO (Ouyang et al. 2022), GRPO (Shao et al.
2024, DeepSeekMath), Dr.GRPO (Liu et al. 2025), REINFORCE++ (Hu 2025), RLOO (Ahmadian et
al. 2024), GSPO (Zheng et al. 2025), DAPO (Yu et al. 2025).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "ppo": {
        "algorithm": {
            "advantage": "gae",
            "gamma": 1.0,
            "lam": 0.95,
            "kl_mode": "reward",
            "kl_estimator": "k1",
            "kl_coef": 0.01,
            "aggregation": "token_mean",
        },
        "sampling": {"n": 1},
    },
    "grpo": {
        "algorithm": {
            "advantage": "grpo",
            "normalize_std": True,
            "kl_mode": "loss",
            "kl_estimator": "k3",
            "kl_coef": 0.001,
            "aggregation": "seq_mean_token_mean",
        },
        "sampling": {"n": 4},
    },
    "dr_grpo": {
        "algorithm": {"advantage": "dr_grpo", "kl_mode": "none", "kl_coef": 0.0, "aggregation": "constant_normalizer"},
        "sampling": {"n": 4},
    },
    "reinforce_pp": {
        "algorithm": {
            "advantage": "reinforce_plus_plus",
            "kl_mode": "reward",
            "kl_estimator": "k2",
            "kl_coef": 0.01,
            "aggregation": "token_mean",
        },
        "sampling": {"n": 1},
    },
    "reinforce_pp_baseline": {
        "algorithm": {
            "advantage": "reinforce_plus_plus_baseline",
            "kl_mode": "loss",
            "kl_estimator": "k3",
            "kl_coef": 0.001,
            "aggregation": "token_mean",
        },
        "sampling": {"n": 4},
    },
    "rloo": {
        "algorithm": {
            "advantage": "rloo",
            "kl_mode": "reward",
            "kl_estimator": "k1",
            "kl_coef": 0.01,
            "aggregation": "token_mean",
        },
        "sampling": {"n": 4},
    },
    "gspo": {
        "algorithm": {
            "advantage": "grpo",
            "policy_loss": "gspo",
            "clip_eps_low": 3e-4,
            "clip_eps_high": 4e-4,
            "kl_mode": "none",
            "kl_coef": 0.0,
            "aggregation": "seq_mean_token_mean",
        },
        "sampling": {"n": 4},
    },
    "dapo": {
        "algorithm": {
            "advantage": "grpo",
            "clip_eps_low": 0.2,
            "clip_eps_high": 0.28,
            "kl_mode": "none",
            "kl_coef": 0.0,
            "aggregation": "token_mean",
            "dynamic_sampling": True,
            "overlong_buffer": 16,
            "overlong_penalty": 1.0,
        },
        "sampling": {"n": 4},
    },
}
