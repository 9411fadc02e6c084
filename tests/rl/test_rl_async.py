"""Asynchronous rollout (``rollout.max_staleness: 1``): the next step's samples are generated while
the current step trains, so they come from weights one update old, and a resumed run picks up
the prompts that were in flight when it stopped."""

from __future__ import annotations

import json
import math

import pytest

from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import resolve, rl_config_data, set_dotted

pytestmark = pytest.mark.slow


def _async_run_config(model_dir, prompt_file, out):
    data = rl_config_data(model_dir, prompt_file, out, "grpo")
    data["train"].update(max_steps=3, log_samples=16)
    data.setdefault("rollout", {})["max_staleness"] = 1
    data["optim"]["scheduler"] = "constant"
    return data


def _prompts_of_step(out, step: int) -> list[str]:
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return [r["prompt"] for r in rows if r["step"] == step]


def test_async_samples_are_one_update_old_and_resume_keeps_the_prompts_in_flight(
        ray_session, rl_model_dir, prompt_file, tmp_path):
    straight = _async_run_config(rl_model_dir, prompt_file, tmp_path / "straight")
    RLTrainer(resolve(tmp_path, straight)).run()
    records = read_metrics(tmp_path / "straight")
    assert [r["step"] for r in records] == [1, 2, 3]
    # Step 1 is generated before any update; steps 2 and 3 were generated during the step before,
    # by the engines one weight sync behind the policy that trains on them.
    assert [r["rollout/weight_lag"] for r in records] == [0, 1, 1]
    for record in records:
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float))
        assert record["policy/grad_norm"] > 0
    # The ratio runs against the engine's log-probs of weights one update old: no longer 1 (KL > 0).
    assert records[2]["policy/approx_kl"] > 0

    # Stop after step 2 (a checkpoint each step), then continue to step 3: step 3 trains on the
    # prompts the stopped run had already sent to the engines.
    resumed = set_dotted(_async_run_config(rl_model_dir, prompt_file, tmp_path / "resumed"), "train.save_every", 1)
    RLTrainer(resolve(tmp_path, set_dotted(resumed, "train.max_steps", 2))).run()
    RLTrainer(resolve(tmp_path, set_dotted(resumed, "train.max_steps", 3))).run()  # (set_dotted edits in place)
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [1, 2, 3]
    for step in (1, 2, 3):
        assert _prompts_of_step(tmp_path / "resumed", step) == _prompts_of_step(tmp_path / "straight", step)
