"""The adapter check of a LoRA policy served as a vLLM adapter (raylign.rl.verify), on log-probs
made by hand: the expected errors are computed in the comments."""

from __future__ import annotations

import pytest

from raylign.rollout.base import TokenScores


def _scores(logprobs: list[float]) -> TokenScores:
    return TokenScores(3, "float32", logprobs)


def test_the_adapter_check_measures_the_engines_shift_against_the_policys():
    from raylign.rl.verify import AdapterMismatch, compare_adapter_shift

    off = [-1.0, -2.0, -3.0, -4.0]
    shift = [0.2, -0.4, 0.1, 0.3]  # mean |shift| = 0.25
    on = [a + b for a, b in zip(off, shift)]
    # An engine that applies the adapter: error 0 (its base-model gap is 0 here).
    metrics = compare_adapter_shift(3, (on, off), [(_scores(on), _scores(off))], ["engine 0"])
    assert metrics == pytest.approx({"sync/adapter_shift_policy": 0.25, "sync/adapter_shift_error": 0.0})
    # One that applies 1.2 times the adapter: error 0.2, within 0.25.
    scaled = [a + 1.2 * b for a, b in zip(off, shift)]
    metrics = compare_adapter_shift(3, (on, off), [(_scores(scaled), _scores(off))], ["engine 0"])
    assert metrics["sync/adapter_shift_error"] == pytest.approx(0.2)
    # One that ignores it: error 1, and the run stops naming the sync and the engine.
    with pytest.raises(AdapterMismatch, match=r"weight sync 3: .*engine 1's .* differ by 1 times .* than the 0.25"):
        compare_adapter_shift(
            3, (on, off), [(_scores(on), _scores(off)), (_scores(off), _scores(off))], ["engine 0", "engine 1"]
        )
    # Rounding: an engine whose base-model log-probs are off by 0.05 everywhere may err by 0.25 + 2 * 0.05 / 0.25.
    rounded_off = [a + 0.05 for a in off]
    rounded_on = [a + 0.05 + 1.5 * b for a, b in zip(off, shift)]  # error 0.5 < 0.65
    metrics = compare_adapter_shift(3, (on, off), [(_scores(rounded_on), _scores(rounded_off))], ["engine 0"])
    assert metrics["sync/adapter_shift_error"] == pytest.approx(0.5)
    # A shift too small to tell from a gap of 0.1 (2 * 0.1 / 0.25 >= 0.5) is logged, not judged.
    far_off = [a + 0.1 for a in off]
    metrics = compare_adapter_shift(3, (on, off), [(_scores(far_off), _scores(far_off))], ["engine 0"])
    assert metrics == pytest.approx({"sync/adapter_shift_policy": 0.25})
