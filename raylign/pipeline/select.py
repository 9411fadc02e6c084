"""``raylign select``: training rows from scored generations.

- Best-of-n (rejection-sampling fine-tuning, as in RAFT, Dong et al. 2023, and the
  rejection-sampling stage of Llama 2, Touvron et al. 2023): for each prompt the response
  ``argmax_j r_j`` becomes an SFT row ``{prompt, completion}``, kept only when
  ``r_best >= min_reward`` (when set).
- Best vs worst (iterative DPO, as in Yuan et al. 2024 "Self-Rewarding Language Models" and
  Dong et al. 2024 "RLHF Workflow: From Reward Modeling to Online RLHF"): chosen =
  ``argmax_j r_j``, rejected = ``argmin_j r_j``, kept when ``r_chosen - r_rejected > 0`` and
  ``>= min_margin``, the two texts differ, and ``r_chosen >= min_chosen_reward`` (when set).

Ties go to the earliest response. Empty (whitespace-only) responses are never selected:
the SFT and preference datasets reject empty texts. Nor, unless ``allow_truncated``, are
responses cut off at ``max_new_tokens`` (finish reason "length" in the generate file): a
chosen one would teach an unfinished answer, and on the rejected side of a pair it would teach
mainly that a cut-off text is worse. A row without ``finish_reasons`` counts as finished. A
prompt given as a conversation also gets ``messages`` (the conversation and the chosen reply)
in its SFT row, which ``raylign sft`` reads in chat format.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

from raylign.config.pipeline import BestOfNConfig, PairsConfig, SelectConfig
from raylign.data import require_list
from raylign.pipeline.files import GeneratedRow, JsonlWriter, parse_rewards, read_generated_rows, require_kept_keys

log = logging.getLogger("raylign")

# The finish reason of a response that reached max_new_tokens before it ended.
TRUNCATED = "length"


def usable_indices(responses: Sequence[str]) -> list[int]:
    """Positions of the responses with some non-whitespace text."""
    return [i for i, text in enumerate(responses) if text.strip()]


def truncated_responses(row: GeneratedRow) -> list[bool] | None:
    """Per response, whether it was cut off at ``max_new_tokens`` (its finish reason is "length"); None for a
    row without ``finish_reasons``."""
    if row.data.get("finish_reasons") is None:
        return None
    reasons = require_list(row.data, "finish_reasons", row.where)
    if len(reasons) != len(row.responses):
        raise row.where.error(
            "finish_reasons",
            f"{len(reasons)} finish reasons for {len(row.responses)} responses; one per response",
            "length_mismatch",
        )
    for i, reason in enumerate(reasons):
        if not isinstance(reason, str):
            raise row.where.error(f"finish_reasons[{i}]", f"expected a string, got {reason!r:.80}", "wrong_type")
    return [reason == TRUNCATED for reason in reasons]


def best_index(rewards: Sequence[float], candidates: Sequence[int]) -> int:
    """The candidate with the highest reward; the earliest one on a tie."""
    return max(candidates, key=lambda i: (rewards[i], -i))


def worst_index(rewards: Sequence[float], candidates: Sequence[int]) -> int:
    """The candidate with the lowest reward; the earliest one on a tie."""
    return min(candidates, key=lambda i: (rewards[i], i))


def select_best_of_n(
    row: GeneratedRow, rewards: list[float], truncated: Sequence[bool], cfg: BestOfNConfig
) -> tuple[dict[str, Any] | None, str]:
    """(SFT row, "kept") for the best response of ``row`` not marked ``truncated``, or (None, why it was
    skipped)."""
    usable = usable_indices(row.responses)
    if not usable:
        return None, "no_usable_response"
    candidates = [i for i in usable if not truncated[i]]
    if not candidates:
        return None, "all_responses_truncated"
    best = best_index(rewards, candidates)
    if cfg.min_reward is not None and rewards[best] < cfg.min_reward:
        return None, "below_min_reward"
    completion = row.responses[best]
    out: dict[str, Any] = {"prompt": row.prompt, "completion": completion, "reward": rewards[best]}
    if row.is_conversation:
        out["messages"] = [*row.prompt, {"role": "assistant", "content": completion}]
    return out, "kept"


def select_pair(
    row: GeneratedRow, rewards: list[float], truncated: Sequence[bool], cfg: PairsConfig
) -> tuple[dict[str, Any] | None, str]:
    """(preference row, "kept") of the best and worst responses of ``row`` not marked ``truncated``, or
    (None, why it was skipped)."""
    usable = usable_indices(row.responses)
    if len(usable) < 2:
        return None, "fewer_than_two_usable_responses"
    candidates = [i for i in usable if not truncated[i]]
    if not candidates:
        return None, "all_responses_truncated"
    if len(candidates) < 2:
        return None, "fewer_than_two_finished_responses"
    chosen, rejected = best_index(rewards, candidates), worst_index(rewards, candidates)
    margin = rewards[chosen] - rewards[rejected]
    if margin <= 0:
        return None, "all_rewards_equal"
    if row.responses[chosen] == row.responses[rejected]:
        return None, "identical_texts"
    if margin < cfg.min_margin:
        return None, "below_min_margin"
    if cfg.min_chosen_reward is not None and rewards[chosen] < cfg.min_chosen_reward:
        return None, "below_min_chosen_reward"
    return {
        "prompt": row.prompt,
        "chosen": row.responses[chosen],
        "rejected": row.responses[rejected],
        "chosen_reward": rewards[chosen],
        "rejected_reward": rewards[rejected],
        "margin": margin,
    }, "kept"


def _summary(name: str, counts: Counter[str], rows: int) -> dict[str, int]:
    out = {f"{name}/rows_written": counts["kept"]}
    out.update({f"{name}/skipped/{reason}": n for reason, n in sorted(counts.items()) if reason != "kept"})
    if counts["kept"] == 0 and rows:
        log.warning("%s: no row of the %d prompts was selected; the output file is empty", name, rows)
    return out


def _log_truncation(left_out: int, rows_without_reasons: int, rows: int, cfg: SelectConfig) -> None:
    if left_out:
        log.info(
            "left out %d responses cut off at max_new_tokens (finish reason 'length'; see allow_truncated)", left_out
        )
    if rows_without_reasons and not cfg.allow_truncated:
        log.warning(
            "%d of %d rows have no finish_reasons: their responses count as finished", rows_without_reasons, rows
        )


def run_select(cfg: SelectConfig) -> dict[str, int]:
    """Write the best-of-n SFT rows and / or best-vs-worst pairs of ``input_path``; returns the counts."""
    selectors = []
    if cfg.best_of_n.output_path is not None:
        selectors.append(("best_of_n", cfg.best_of_n.output_path, partial(select_best_of_n, cfg=cfg.best_of_n)))
    if cfg.pairs.output_path is not None:
        selectors.append(("pairs", cfg.pairs.output_path, partial(select_pair, cfg=cfg.pairs)))
    counts: dict[str, Counter[str]] = {name: Counter() for name, _, _ in selectors}
    rows = left_out = rows_without_reasons = 0
    with contextlib.ExitStack() as stack:
        writers = {name: stack.enter_context(JsonlWriter(path)) for name, path, _ in selectors}
        for row in read_generated_rows(cfg.input_path):
            rewards = parse_rewards(row)
            kept = require_kept_keys(row, cfg.keep_keys)
            truncated = truncated_responses(row)
            rows += 1
            rows_without_reasons += truncated is None
            if truncated is None or cfg.allow_truncated:
                truncated = [False] * len(row.responses)
            left_out += sum(truncated)
            for name, _, select in selectors:
                out, reason = select(row, rewards, truncated)
                counts[name][reason] += 1
                if out is not None:
                    writers[name].write({**out, **kept})
    stats: dict[str, int] = {"rows_read": rows}
    if left_out:
        stats["truncated_responses_left_out"] = left_out
    _log_truncation(left_out, rows_without_reasons, rows, cfg)
    for name, path, _ in selectors:
        stats.update(_summary(name, counts[name], rows))
        log.info("%s: wrote %d rows to %s", name, counts[name]["kept"], path)
    skipped = {k: v for k, v in stats.items() if "/skipped/" in k}
    if skipped:
        log.info("skipped prompts: %s", ", ".join(f"{k} {v}" for k, v in skipped.items()))
    return stats
