"""The calculator-agent example learns: after RL the tiny model calls the tool more often and answers
more held-out products of 3-digit numbers exactly than after its warm-up.

A shortened run of ``examples/agent_calculator.py`` (fewer warm-up and RL steps than its defaults):
a short warm-up leaves the model guessing three times in four, the reward is 1 only for the exact
product, which a guess rounded to thousands almost never is, so GRPO can only raise it by moving
the policy to the tool.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from raylign.trainers.metrics import read_metrics

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_calculator.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("agent_calculator", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rl_raises_tool_use_and_success_on_held_out_products(ray_session, tmp_path):
    example = _load_example()
    args = example.parse_args(
        [
            "--output-dir",
            str(tmp_path),
            "--sft-steps",
            "200",
            "--rl-steps",
            "8",
            "--prompts-per-step",
            "8",
            "--eval-every",
            "8",
        ]
    )
    summary = example.run(args)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    before, after = summary["before_rl"], summary["after_rl"]
    # 64 held-out questions: a rise of 0.25 is 16 more questions answered exactly
    assert after["success"] >= before["success"] + 0.25, summary
    assert after["tool_use"] >= before["tool_use"] + 0.25, summary
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "rl") if "reward/mean" in r]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    trajectory = json.loads((tmp_path / "rl" / "trajectories.jsonl").read_text().splitlines()[-1])
    assert {seg["source"] for seg in trajectory["segments"]} <= {"policy", "env"}
