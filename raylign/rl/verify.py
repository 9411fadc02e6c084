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

A LoRA policy whose engines serve its adapter (``rollout.lora_sync: adapter``) is also checked for
the failure the difference alone can miss while the adapter is still small: an engine that applies
the adapter wrongly (another scaling, other target modules) or not at all. Both sides also score
the probe without the adapter; the adapter's shift of the policy's log-probs, ``p_t = on_t - off_t``,
and of the engine's, ``e_t``, are compared by their relative difference

    r = mean_t |e_t - p_t| / mean_t |p_t|      (sync/adapter_shift_error)

0 when the engine applies the trained adapter, 1 when it ignores it, about 1 for a scaling off by
2x. The two sides' rounding adds at most ``n = 2 g / mean_t |p_t|`` to it, where ``g`` is the
engine's gap to the policy on the base model; the run stops with :class:`AdapterMismatch` when
``r > 0.25 + n``, judged only once the shift is large enough that ``n < 0.5``.

Default threshold: an fp32 engine and an fp32 trainer differ only by the order of floating-point
sums (measured: at most 5e-5 on a 135M model, under 1e-5 on the test models), so 1e-3 leaves a
20x margin; bf16 or fp16 on either side shifts single log-probs by up to tenths, so 1.0 there,
which still catches an engine with other weights (off by nats). A run that knows its own gap
sets a tighter value from the logged ``sync/probe_logprob_diff_max``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from raylign.rollout.base import TokenScores
from raylign.rollout.weight_sync import WeightSyncMismatch

PROBE_TOKENS = 64  # long enough to touch every layer with real context, short enough to cost one small prefill
FLOAT32_MAX_DIFF = 1e-3
LOW_PRECISION_MAX_DIFF = 1.0
SETTING = "rollout.verify_max_logprob_diff"


class WeightSyncDrift(RuntimeError):
    """An engine's log-probs of the probe differ from the policy's by more than the threshold."""


class AdapterMismatch(RuntimeError):
    """An engine's LoRA adapter moves its log-probs of the probe otherwise than the policy's adapter
    moves the policy's."""


ADAPTER_MAX_ERROR = 0.25  # relative error of the engine's shift, beyond the rounding of the two sides
ADAPTER_MAX_NOISE = 0.5  # judged once the rounding can add at most this much to it


def compare_adapter_shift(
    version: int,
    policy: tuple[list[float], list[float]],
    engines: Sequence[tuple[TokenScores, TokenScores]],
    names: Sequence[str],
) -> dict[str, float]:
    """The adapter check (see the module docstring). ``policy``: the policy's log-probs of the probe
    with and without its adapter; ``engines[i]``: engine ``names[i]``'s scores, with and without."""
    on, off = policy
    shift = [a - b for a, b in zip(on, off)]
    size = sum(abs(x) for x in shift) / len(shift)
    metrics = {"sync/adapter_shift_policy": size}
    errors: list[float] = []
    for name, (engine_on, engine_off) in zip(names, engines):
        gap = sum(abs(a - b) for a, b in zip(engine_off.logprobs, off)) / len(off)
        if size == 0.0 or 2 * gap / size >= ADAPTER_MAX_NOISE:
            continue  # the adapter's effect is still too small to tell from the two sides' rounding
        moved = [a - b for a, b in zip(engine_on.logprobs, engine_off.logprobs)]
        error = sum(abs(e - p) for e, p in zip(moved, shift)) / len(shift) / size
        errors.append(error)
        allowed = ADAPTER_MAX_ERROR + 2 * gap / size
        if error > allowed:
            raise AdapterMismatch(
                f"weight sync {version}: the LoRA adapter moves {name}'s log-probs of the probe sequence otherwise "
                f"than the policy's adapter moves the policy's: they differ by {error:.3g} times the policy's mean "
                f"shift ({size:.3g}), more than the {allowed:.3g} the two sides' rounding allows. The engine applies "
                "another adapter than the one trained (another scaling, other target modules, other weights) or "
                "none, and a run in this state does not learn what it trains; it stops here. rollout.lora_sync: "
                "merged sends merged full weights instead"
            )
    if errors:
        metrics["sync/adapter_shift_error"] = max(errors)
    return metrics


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
    pool: Any,
    policy: Any,
    probe: list[int],
    version: int,
    names: Sequence[str],
    max_diff: float | None,
    adapter: bool = False,
    between: Callable[[], None] | None = None,
    at_once: bool = True,
) -> dict[str, float]:
    """Score ``probe`` on every engine of ``pool`` and on the ``policy`` worker group (every rank
    takes part; rank 0's answer), the two at once, then :func:`compare_probe`; with ``adapter`` (the
    engines serve the policy's LoRA adapter) both also without it, for :func:`compare_adapter_shift`.
    With ``between``, or ``at_once`` false (the two would compute on the same cores:
    :func:`raylign.rl.placement.probes_at_once`), the policy scores first, then ``between()`` runs (a
    colocated run moves the policy's weights out and wakes the engines' cache there), then the
    engines score. Adds the time it took."""
    start = time.perf_counter()
    in_turn = between is not None or not at_once
    submitted = None if in_turn else pool.submit_score(probe)
    scored = policy.call("score_probe", probe)[0]
    scored_base = policy.call("score_probe", probe, True)[0] if adapter else None
    if in_turn:
        if between is not None:
            between()
        submitted = pool.submit_score(probe)
    engines = pool.scores(submitted)
    metrics = compare_probe(version, scored, engines, names, max_diff)
    if scored_base is not None:
        # The base-model probe goes in once the adapter's has come back, so neither shares a batch with
        # the other (the two must differ only by the adapter).
        engines_base = pool.scores(pool.submit_score(probe, True))
        pairs = list(zip(engines, engines_base))
        metrics.update(compare_adapter_shift(version, (scored[1], scored_base[1]), pairs, names))
    return {**metrics, "sync/probe_s": time.perf_counter() - start}
