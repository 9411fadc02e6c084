"""Reward sources for online RL: Python functions, reward models, HTTP scorers, verifiable checks.

Every source implements ``RewardSource.score(prompts, responses, labels, metadata) ->
RewardResult(rewards, metrics)``; :func:`build_reward` turns a :class:`RewardConfig` into a
:class:`CombinedReward` that weights them. Heavy dependencies (torch, Ray, httpx, math-verify)
are imported only by the sources that need them.
"""

from raylign.config.reward import RewardConfig, RewardSourceConfig
from raylign.rollout.rewards.base import RewardError, RewardResult, RewardSource
from raylign.rollout.rewards.builtin import ExactMatchReward, FormatReward, MathReward
from raylign.rollout.rewards.combined import CombinedReward, WeightedSource, build_reward, build_source
from raylign.rollout.rewards.function import PythonFileReward
from raylign.rollout.rewards.remote import HttpRewardSource
from raylign.rollout.rewards.rendering import PROMPT_MESSAGES_KEY
from raylign.rollout.rewards.reward_model import LocalRewardModel, RewardModelScorer, RewardModelSource

__all__ = [
    "PROMPT_MESSAGES_KEY",
    "CombinedReward",
    "ExactMatchReward",
    "FormatReward",
    "HttpRewardSource",
    "LocalRewardModel",
    "MathReward",
    "PythonFileReward",
    "RewardConfig",
    "RewardError",
    "RewardModelScorer",
    "RewardModelSource",
    "RewardResult",
    "RewardSource",
    "RewardSourceConfig",
    "WeightedSource",
    "build_reward",
    "build_source",
]
