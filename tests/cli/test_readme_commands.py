"""The README's commands, run as a newcomer runs them: in a fresh clone, from a clean environment.

Nothing is inherited from the test suite (see ``tests/clean_run.py``). The install part of the
first command (``bash scripts/install.sh``) is what ``.ci/run`` itself does on a fresh clone; here
the clone uses the environment that install made.
"""

from __future__ import annotations

import json
import re

import pytest

from raylign.trainers.metrics import read_metrics
from raylign.trainers.plots import plot_quickstart_reward
from tests.clean_run import REPO, fresh_clone, run_clean


def readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_readme_opens_with_install_then_quickstart():
    assert readme_blocks()[0].strip() == "bash scripts/install.sh && .venv/bin/raylign quickstart"


@pytest.mark.slow
def test_quickstart_as_written_learns_to_the_stated_targets(tmp_path):
    """The run part of the README's first command meets the first-run targets: after the warm-up the
    held-out mean reward is at most 0.35; after RL it is at least 0.8 with at least half the answers
    exact, and RL added more than the warm-up did."""
    clone = fresh_clone(tmp_path)
    run_part = readme_blocks()[0].strip().split("&&")[1].strip()
    proc = run_clean(run_part, clone, timeout=1800)
    out = clone / "outputs" / "quickstart"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["after_warmup"]["reward"] <= 0.35
    assert summary["after_rl"]["reward"] >= 0.8
    assert summary["after_rl"]["exact_match"] >= 0.5
    rl_gain = summary["after_rl"]["reward"] - summary["after_warmup"]["reward"]
    warmup_gain = summary["after_warmup"]["reward"] - summary["base_model"]["reward"]
    assert rl_gain > warmup_gain
    assert (out / "rl" / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The documentation's figure of this run (scripts/docs_plots.py): every step's reward, the held-out
    # evaluations at the start and every 20 steps, the last of them the one summary.json reports.
    drawn = plot_quickstart_reward(read_metrics(out / "rl"), tmp_path / "quickstart_reward.png", "this run")
    assert [step for step, _ in drawn["reward/mean"]] == list(range(1, 81))
    assert [step for step, _ in drawn["eval/all/reward_mean"]] == [0, 20, 40, 60, 80]
    assert drawn["eval/all/reward_mean"][-1][1] == summary["after_rl"]["reward"]
    assert (out / "rl" / "final" / "config.json").exists()
    # The closing lines say in words what improved; logs are plain lines without a terminal.
    assert "RL raised the held-out mean reward" in proc.stderr
    assert "━" not in proc.stderr + proc.stdout
    # Nor warnings a newcomer can do nothing about (each was there once): DeepSpeed's accelerator probe
    # on every model save, numpy's subnormal limits after denormals were flushed.
    for noise in ("Setting accelerator to CPU", "smallest subnormal"):
        assert noise not in proc.stderr + proc.stdout, noise


@pytest.mark.slow
def test_rl_tiny_example_after_its_preparation_commands(tmp_path):
    """``raylign rl --config examples/rl_grpo_tiny.yaml`` after the commands its README section and
    its own header give (build the tiny model, SFT warm-up), in the activated environment."""
    clone = fresh_clone(tmp_path)
    header = (clone / "examples" / "rl_grpo_tiny.yaml").read_text()
    assert "raylign tiny-model && raylign sft --config examples/sft_tiny.yaml" in header
    commands = (
        "source .venv/bin/activate && raylign tiny-model --output_dir outputs/tiny-model"
        " && raylign sft --config examples/sft_tiny.yaml && raylign rl --config examples/rl_grpo_tiny.yaml"
    )
    run_clean(commands, clone, timeout=1200)
    out = clone / "outputs" / "rl-grpo-tiny"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(row["step"] for row in steps) == 40
    assert (out / "final" / "config.json").exists()
