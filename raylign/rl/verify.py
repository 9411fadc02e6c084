"""Checking, after a weight sync, that every engine computes what the policy computes.

The bucket checksums of a sync (:mod:`raylign.rollout.sync_wire`) prove that the bytes arrived
as sent; they cannot tell whether the engine loaded them into the right places, or whether its
weights changed afterwards. So every ``rollout.verify_every`` syncs a fixed probe sequence is
scored by each engine (:meth:`RolloutEngine.score`: one prefill) and by the policy workers (the
training forward), both at temperature 1, and the difference of the log-probs

    d_t = |log p_engine(x_t | x_<t) - log p_policy(x_t | x_<t)|,   t = 1 .. L-1

is logged (``sync/probe_logprob_diff_max`` = max over engines and t, ``..._mean`` = its mean).
Past ``rollout.verify_max_logprob_diff`` the run stops with :class:`WeightSyncDrift`, naming the
sync, the engine and the difference. The engine also reports the weight version it holds, which
must be the one just sent.

Default threshold: an fp32 engine and an fp32 trainer differ only by the order of floating-point
sums (measured: at most 5e-5 on a 135M model, under 1e-5 on the test models), so 1e-3 leaves a
20x margin; bf16 or fp16 on either side shifts single log-probs by up to tenths, so 1.0 there,
which still catches an engine with other weights (off by nats). A run that knows its own gap
sets a tighter value from the logged ``sync/probe_logprob_diff_max``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from raylign.rollout.base import TokenScores
from raylign.rollout.weight_sync import WeightSyncMismatch

PROBE_TOKENS = 64  # long enough to touch every layer with real context, short enough to cost one small prefill
FLOAT32_MAX_DIFF = 1e-3
LOW_PRECISION_MAX_DIFF = 1.0
SETTING = "rollout.verify_max_logprob_diff"


class WeightSyncDrift(RuntimeError):
    """An engine's log-probs of the probe differ from the policy's by more than the threshold."""


def probe_sequence(prompts: Sequence[Sequence[int]], max_tokens: int) -> list[int]:
    """The probe: the training prompts' token ids concatenated in their order, cut to ``max_tokens``."""
    probe: list[int] = []
    for prompt in prompts:
        probe += list(prompt)[: max_tokens - len(probe)]
        if len(probe) >= max_tokens:
            break
    if len(probe) < 2:
        raise ValueError(
            f"the weight-sync probe needs at least 2 tokens, and the training prompts hold {len(probe)} (or "
            "rollout.max_model_len leaves room for fewer); set rollout.verify_every: 0 to turn the probe off"
        )
    return probe


def default_max_diff(dtypes: Sequence[str]) -> float:
    """The threshold for engines and a policy computing in ``dtypes`` (see the module docstring)."""
    return FLOAT32_MAX_DIFF if all(d == "float32" for d in dtypes) else LOW_PRECISION_MAX_DIFF


def compare_probe(
    version: int,
    policy: tuple[str, list[float]],
    engines: Sequence[TokenScores],
    names: Sequence[str],
    max_diff: float | None,
) -> dict[str, float]:
    """The probe's metrics; raises if an engine holds another version or differs past the threshold.

    ``policy``: the policy's (dtype, log-probs); ``engines[i]``: engine ``names[i]``'s scores;
    ``max_diff``: the threshold, None for :func:`default_max_diff` of the dtypes involved."""
    policy_dtype, policy_logprobs = policy
    for name, scores in zip(names, engines):
        if scores.version != version:
            raise WeightSyncMismatch(
                f"weight sync {version}: {name} reports weight version {scores.version} when probed right after it"
            )
        if len(scores.logprobs) != len(policy_logprobs):
            raise RuntimeError(
                f"weight sync {version}: {name} scored {len(scores.logprobs)} probe tokens, the policy "
                f"{len(policy_logprobs)}"
            )
    threshold = max_diff if max_diff is not None else default_max_diff([policy_dtype, *(s.dtype for s in engines)])
    diffs = [[abs(a - b) for a, b in zip(s.logprobs, policy_logprobs)] for s in engines]
    worst = max(range(len(engines)), key=lambda i: max(diffs[i]))
    largest = max(diffs[worst])
    mean = sum(sum(d) for d in diffs) / sum(len(d) for d in diffs)
    if largest > threshold:
        how = "" if max_diff is not None else f" (the default for {policy_dtype} policy, {engines[worst].dtype} engine)"
        raise WeightSyncDrift(
            f"weight sync {version}: {names[worst]} disagrees with the policy on the probe sequence "
            f"({len(policy_logprobs) + 1} tokens): log-probs differ by up to {largest:.3g} (mean over engines "
            f"{mean:.3g}), more than {SETTING}={threshold:g}{how}. The engine holds other weights than the "
            "policy (loaded into the wrong places, or changed after the sync); the run stops here: resume from "
            f"the last checkpoint, or raise {SETTING} if this gap is expected for these dtypes"
        )
    return {
        "sync/probe_logprob_diff_max": largest,
        "sync/probe_logprob_diff_mean": mean,
        "sync/engine_version": float(version),
    }


def verify_sync(
    pool: Any, policy: Any, probe: list[int], version: int, names: Sequence[str], max_diff: float | None
) -> dict[str, float]:
    """Score ``probe`` on every engine of ``pool`` and on the ``policy`` worker group (every rank
    takes part; rank 0's answer), the two at once, then :func:`compare_probe`; adds the time it took."""
    start = time.perf_counter()
    submitted = pool.submit_score(probe)
    scored = policy.call("score_probe", probe)[0]
    engines = pool.scores(submitted)
    metrics = compare_probe(version, scored, engines, names, max_diff)
    return {**metrics, "sync/probe_s": time.perf_counter() - start}
