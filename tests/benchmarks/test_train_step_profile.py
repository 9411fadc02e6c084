"""benchmarks/train_step_profile.py on a tiny model: every phase of the worker's update is timed, and a
baseline checkout (here this same tree) takes turns with this tree on the same work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raylign.models.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "train_step_profile.py"
TIMED = ("forward", "logprobs", "loss", "backward", "step", "experience")


def test_each_phase_is_timed_on_both_sides_and_their_losses_agree(tmp_path):
    folder = build_tiny_model(tmp_path / "tiny", arch="qwen2")
    command = [sys.executable, str(SCRIPT), "--model", str(folder), "--dtype", "float32", "--repeats", "2"]
    command += ["--threads", "1", "--baseline", str(REPO), "--profile", "--top", "3"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tables = [part for part in done.stdout.split("\n\n") if "median of 2 steps" in part]
    assert len(tables) == 2
    for table in tables:
        rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:]}
        assert all(float(rows[phase][0]) > 0 for phase in TIMED), table
        parts = sum(float(rows[phase][0]) for phase in (*TIMED[:-1], "other"))
        assert parts == pytest.approx(float(rows["total"][0]), abs=0.003)  # each printed to 1 ms
    losses = [re.search(r"losses: (.*)", table).group(1).split() for table in tables]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    assert done.stdout.count("top operators by self CPU time, all phases") == 2
    # The floors at the model's own product rates, attention counted: one table per side, whose forward
    # floor adds attention's FLOP at the square rate to the products' at the rates printed beside it.
    shaped = [part for part in done.stdout.split("\n\n") if "at this model's own products" in part]
    assert len(shaped) == 2
    for part in shaped:
        rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in part.splitlines()[1:]}
        assert set(rows) == {"forward", "backward", "total", "experience"}
        # Each of the three printed to 0.01 s: the sum of two rounded values is within 0.005 + 0.005 of theirs,
        # and the rounded total within 0.005 of that (0.04 against 0.01 + 0.02 came up in a run).
        assert rows["total"][1] == pytest.approx(rows["forward"][1] + rows["backward"][1], abs=0.0151)
        assert rows["experience"][1] == rows["forward"][1]


def test_attention_flop_is_two_length_squared_times_the_query_width_per_layer():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from train_step_profile import attention_flop

    from raylign.rl.experience import Sample

    class Config:  # 3 layers, 4 heads of 16: queries 64 wide
        num_attention_heads, hidden_size, head_dim, num_hidden_layers = 4, 64, 16, 3

    class Model:
        config = Config()

    samples = [
        Sample([1] * 5, [2] * 3, [0.0] * 3, "", "", None, "t", "stop"),
        Sample([1] * 2, [2], [0.0], "", "", None, "t", "stop"),
    ]
    # Causal Q K^T and A V: 2 x L^2 x width / 2 each; lengths 8 and 3.
    assert attention_flop(Model(), samples) == 3 * (2 * 8**2 * 64 + 2 * 3**2 * 64)
