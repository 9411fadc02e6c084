"""A quickstart shorter than its learning-rate warm-ups still runs: each warm-up is cut to the run's length."""

from __future__ import annotations

import pytest

from raylign.cli.quickstart import QuickstartConfig, run_quickstart
from raylign.trainers.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_a_one_step_quickstart_runs_at_the_full_learning_rate(ray_session, tmp_path, caplog):
    cfg = QuickstartConfig(
        output_dir=str(tmp_path),
        sft_steps=1,
        rl_steps=1,
        ppo_epochs=1,
        prompts_per_step=2,
        samples_per_prompt=2,
        hidden_size=32,
    )
    with caplog.at_level("INFO", logger="raylign"):
        summary = run_quickstart(cfg)
    assert set(summary) == {"base_model", "after_warmup", "after_rl", "seconds"}
    # A warm-up of one step: the first step's multiplier is (0 + 1) / 1, the full rate; the quickstart's
    # usual warm-ups (5 SFT steps, 10 RL updates) would fail to start here, or give 1/5 and 1/10 of it.
    (sft_step,) = [r for r in read_metrics(tmp_path / "sft") if "train/lr" in r]
    (rl_step,) = [r for r in read_metrics(tmp_path / "rl") if "policy/lr" in r]
    assert sft_step["train/lr"] == pytest.approx(3e-3)  # the quickstart's SFT rate
    assert rl_step["policy/lr"] == pytest.approx(cfg.rl_lr)
    # The closing line says whether one GRPO step raised the held-out reward, as the summary's figures do.
    before, after = summary["after_warmup"]["reward"], summary["after_rl"]["reward"]
    verb = "raised" if after > before else "did not raise"
    assert f"RL {verb} the held-out mean reward ({before:.3f} to {after:.3f};" in caplog.text
