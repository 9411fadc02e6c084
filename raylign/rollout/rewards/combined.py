"""Several reward sources as one: ``reward = sum_i weight_i * reward_i``, each source also a metric."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raylign.config.reward import RewardConfig, RewardSourceConfig
from raylign.rollout.rewards.base import RewardError, RewardResult, RewardSource


@dataclass
class WeightedSource:
    name: str
    weight: float
    source: RewardSource


class CombinedReward(RewardSource):
    """The weighted sum of its sources.

    Metrics: ``<name>`` is source ``name``'s own (unweighted) reward, and ``<name>/<metric>`` each
    metric that source reports. Sources run one after another on the whole batch.
    """

    description = "combined reward"

    def __init__(self, sources: list[WeightedSource]):
        if not sources:
            raise ValueError("a combined reward needs at least one source")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"reward source names must be unique, got {names}")
        self.sources = sources

    def _score(self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]) -> RewardResult:
        total = [0.0] * len(prompts)
        metrics: dict[str, list[float]] = {}
        for item in self.sources:
            try:
                result = item.source.score(prompts, responses, labels, metadata)
            except RewardError as err:
                raise RewardError(f"reward source '{item.name}': {err}") from err
            total = [t + item.weight * r for t, r in zip(total, result.rewards)]
            metrics[item.name] = result.rewards
            metrics.update({f"{item.name}/{k}": v for k, v in result.metrics.items()})
        return RewardResult(rewards=total, metrics=metrics)

    @property
    def restarts(self) -> int:  # type: ignore[override]
        return sum(item.source.restarts for item in self.sources)

    def close(self) -> None:
        for item in self.sources:
            item.source.close()


def build_source(cfg: RewardSourceConfig, startup_timeout_s: float = 600.0) -> RewardSource:
    """The reward source ``cfg`` describes (starts its worker processes or Ray actor, waiting at most
    ``startup_timeout_s`` for them)."""
    if cfg.kind == "function":
        from raylign.rollout.rewards.function import PythonFileReward

        return PythonFileReward(
            cfg.path,
            cfg.function_name,
            num_workers=cfg.num_workers,
            timeout_s=cfg.timeout_s,
            startup_timeout_s=startup_timeout_s,
        )
    if cfg.kind == "reward_model":
        from raylign.rollout.rewards.reward_model import RewardModelSource

        return RewardModelSource(
            cfg.model_path,
            batch_size=cfg.batch_size,
            normalize=cfg.normalize,
            max_length=cfg.max_length,
            dtype=cfg.dtype,
            num_cpus=cfg.num_cpus,
            num_gpus=cfg.num_gpus,
            startup_timeout_s=startup_timeout_s,
            timeout_s=cfg.timeout_s,
        )
    if cfg.kind == "http":
        from raylign.rollout.rewards.remote import HttpRewardSource

        return HttpRewardSource(
            cfg.url,
            api_key=cfg.resolved_api_key(),
            timeout_s=cfg.timeout_s,
            max_retries=cfg.max_retries,
            backoff_s=cfg.backoff_s,
            batch_size=cfg.batch_size,
        )
    from raylign.rollout.rewards.builtin import ExactMatchReward, FormatReward, MathReward

    if cfg.kind == "math":
        return MathReward()
    if cfg.kind == "exact_match":
        return ExactMatchReward(case_sensitive=cfg.case_sensitive)
    if cfg.kind == "format":
        return FormatReward(cfg.format_regex)
    raise ValueError(f"unknown reward kind {cfg.kind!r}")


def build_reward(cfg: RewardConfig, startup_timeout_s: float = 600.0) -> CombinedReward:
    """All sources of ``cfg`` combined by their weights; on failure the ones already started are closed.
    With ``reward.non_finite: drop`` every source returns NaN and infinities as they are."""
    built: list[WeightedSource] = []
    try:
        for name, source_cfg in zip(cfg.source_names(), cfg.sources):
            built.append(WeightedSource(name, source_cfg.weight, build_source(source_cfg, startup_timeout_s)))
    except BaseException:  # including SystemExit from a SIGTERM during start-up
        for item in built:
            item.source.close()
        raise
    combined = CombinedReward(built)
    for source in [combined] + [item.source for item in built]:
        source.keep_non_finite = cfg.non_finite == "drop"
    return combined
