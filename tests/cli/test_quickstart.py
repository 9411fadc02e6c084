"""The README's main command runs through the installed console script and reports its results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_quickstart_console_script_writes_summary_plot_and_model(tmp_path):
    script = Path(sys.executable).parent / "raylign"
    command = [str(script)] if script.exists() else [shutil.which("raylign") or "raylign"]
    out = tmp_path / "qs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command + ["quickstart", "--output_dir", str(out), "--sft_steps", "20", "--rl_steps", "2",
                                     "--prompts_per_step", "4", "--samples_per_prompt", "2"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= {"reward_before", "reward_after", "exact_match_before", "exact_match_after"}
    assert all(0.0 <= v <= 1.0 for v in summary.values())
    assert (out / "rl" / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "rl" / "final" / "config.json").exists()
    assert "reward curve" in proc.stderr + proc.stdout
