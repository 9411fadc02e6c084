"""``raylign score``: reward every response of a ``raylign generate`` file.

The reward sources are those of ``raylign rl`` (:func:`raylign.rollout.rewards.build_reward`):
reward = sum_i weight_i * reward_i over the sources. Each source sees what it sees in RL: the
prompt as the model saw it (``prompt_text``), the response, the row's ``label``, and as metadata
the row's data ``source`` and other keys (a conversation prompt also as ``prompt_messages``, for
reward models); see :meth:`~raylign.pipeline.files.GeneratedRow.reward_metadata`.
Rows are scored ``batch_size`` at a time, all responses of a row in the same call.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from raylign.config.pipeline import ScoreConfig
from raylign.pipeline.files import GeneratedRow, JsonlWriter, read_generated_rows, write_json
from raylign.pipeline.runtime import ray_runtime
from raylign.rollout.rewards import RewardError, RewardResult, RewardSource, build_reward

log = logging.getLogger("raylign")


def score_rows(reward: RewardSource, rows: list[GeneratedRow]) -> list[RewardResult]:
    """One :class:`RewardResult` per row (a reward per response), from a single call on all their responses."""
    prompts, responses, labels, metadata = [], [], [], []
    for row in rows:
        prompt, label, meta = row.reward_prompt(), row.data.get("label"), row.reward_metadata()
        for response in row.responses:
            prompts.append(prompt)
            responses.append(response)
            labels.append(label)
            metadata.append(meta)
    try:
        result = reward.score(prompts, responses, labels, metadata)
    except (RewardError, ValueError) as err:
        first, last = rows[0].where, rows[-1].where
        place = (
            f"{first.source}, rows {first.row}-{last.row} (samples numbered from 0 over these rows' responses, "
            "in order)"
        )
        kind = RewardError if isinstance(err, RewardError) else ValueError
        raise kind(f"{place}: {err}") from err
    return split_by_row(result, [len(row.responses) for row in rows])


def split_by_row(result: RewardResult, sizes: list[int]) -> list[RewardResult]:
    """Cut a flat result into consecutive pieces of ``sizes`` samples."""
    pieces, start = [], 0
    for size in sizes:
        end = start + size
        pieces.append(
            RewardResult(
                result.rewards[start:end], {name: values[start:end] for name, values in result.metrics.items()}
            )
        )
        start = end
    return pieces


class RewardSummary:
    """Running means over all responses of the reward and each metric, and of the per-prompt best reward."""

    def __init__(self) -> None:
        self.rows = 0
        self.totals: dict[str, list[float]] = {}  # name -> [sum, sum of squares, count]
        self.best_sum = 0.0
        self.non_finite_rows = 0  # left out: a reward was NaN or infinite (reward.non_finite: drop)

    def add(self, result: RewardResult) -> None:
        self.rows += 1
        self.best_sum += max(result.rewards)
        for name, values in {"reward": result.rewards, **result.metrics}.items():
            total = self.totals.setdefault(name, [0.0, 0.0, 0])
            total[0] += sum(values)
            total[1] += sum(v * v for v in values)
            total[2] += len(values)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"rows": self.rows, "responses": self.totals["reward"][2] if self.totals else 0}
        for name, (total, squares, count) in self.totals.items():
            mean = total / count
            out[f"{name}/mean"] = mean
            out[f"{name}/std"] = math.sqrt(max(squares / count - mean * mean, 0.0))
        out["reward/best_of_n_mean"] = self.best_sum / max(self.rows, 1)
        out["non_finite_rows"] = self.non_finite_rows
        return out


def scored_row(row: GeneratedRow, result: RewardResult) -> dict[str, Any]:
    """The input row with its rewards and per-source metrics (replacing any earlier ones)."""
    return {**row.data, "rewards": result.rewards, "reward_metrics": result.metrics}


def _needs_ray(cfg: ScoreConfig) -> bool:
    return any(source.kind == "reward_model" for source in cfg.reward.sources)


def _score_file(cfg: ScoreConfig, rows: list[GeneratedRow]) -> RewardSummary:
    from raylign.trainers.progress import Progress

    summary = RewardSummary()
    with build_reward(cfg.reward, cfg.ray.startup_timeout_s) as reward, JsonlWriter(cfg.output_path) as writer:
        progress = Progress(len(rows), "score", enabled=cfg.progress_bar)
        try:
            for start in range(0, len(rows), cfg.batch_size):
                batch = rows[start : start + cfg.batch_size]
                for row, result in zip(batch, score_rows(reward, batch)):
                    if not all(math.isfinite(r) for r in result.rewards):  # only with reward.non_finite: drop
                        summary.non_finite_rows += 1
                        continue
                    writer.write(scored_row(row, result))
                    summary.add(result)
                progress.advance_to(start + len(batch))
        finally:
            progress.close()
    return summary


def run_score(cfg: ScoreConfig) -> dict[str, float]:
    """Score every response of ``input_path``; write the scored rows and a metrics summary; return the summary."""
    rows = list(read_generated_rows(cfg.input_path))  # every row is checked before any reward is computed
    log.info(
        "scoring %d responses of %d prompts with %s",
        sum(len(r.responses) for r in rows),
        len(rows),
        ", ".join(cfg.reward.source_names()),
    )
    if _needs_ray(cfg):
        cpus = sum(s.num_cpus for s in cfg.reward.sources if s.kind == "reward_model")
        with ray_runtime(cfg.ray, cpus):
            summary = _score_file(cfg, rows)
    else:
        summary = _score_file(cfg, rows)
    metrics = summary.metrics()
    metrics_path = cfg.metrics_file
    write_json(metrics_path, metrics)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.endswith("/mean"))
    log.info("wrote %d scored rows to %s; %s (summary in %s)", summary.rows, cfg.output_path, shown, metrics_path)
    if summary.non_finite_rows:
        log.warning("left out %d rows with a NaN or infinite reward (reward.non_finite: drop)", summary.non_finite_rows)
    return metrics
