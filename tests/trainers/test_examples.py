"""The SFT and RL example configs run as documented (other trainers' examples have their own tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raylign.cli.main import main
from raylign.trainers.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_sft_example_config_runs(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = main(["sft", "--config", "examples/sft_tiny.yaml", "--model.path", str(tiny_model_dir),
                 "--train.output_dir", str(tmp_path / "sft"), "--train.max_steps", "3", "--train.save_every", "0",
                 "--train.logging.progress_bar", "false"])
    assert code == 0
    assert [r["step"] for r in read_metrics(tmp_path / "sft") if "train/loss" in r] == [1, 2, 3]


@pytest.mark.slow
def test_rl_example_config_runs(tmp_path, tiny_model_dir, monkeypatch, ray_session):
    monkeypatch.chdir(ROOT)
    code = main(["rl", "--config", "examples/rl_grpo_tiny.yaml", "--model.path", str(tiny_model_dir),
                 "--train.output_dir", str(tmp_path / "rl"), "--train.max_steps", "2", "--train.prompts_per_step", "4",
                 "--train.save_every", "0", "--train.logging.progress_bar", "false"])
    assert code == 0
    assert [r["step"] for r in read_metrics(tmp_path / "rl") if "reward/mean" in r] == [1, 2]
