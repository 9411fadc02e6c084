"""benchmarks/vllm_engine_start.py end to end on the tiny model: both sides start, generate and stop,
and the figures add up."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "vllm_engine_start.py"


@pytest.mark.slow
def test_each_side_reports_its_start_threads_and_tokens_against_their_floors(tmp_path):
    report = tmp_path / "report.json"
    command = [sys.executable, str(SCRIPT), "--model", "tiny", "--prompts", "4", "--n", "2", "--threads", "1"]
    command += ["--max-new-tokens", "8", "--reps", "2", "--json", str(report)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(report.read_text())
    rows = {row["side"]: row for row in figures["rows"]}
    assert set(rows) == {"raylign", "vllm-default"} and not any(row["errors"] for row in rows.values())
    assert figures["threads"] == 1 and rows["raylign"]["threads"] == 1  # the worker follows OMP_NUM_THREADS
    assert figures["import_floor_s"] > 0
    rate = figures["machine"]["matmul_gflops_1thread"]
    for row in rows.values():
        records = row["records"]
        assert len(records) == 2 and all(4 * 2 <= r["tokens"] <= 4 * 2 * 8 for r in records)
        assert row["start_s"] > 0 and row["stop_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(records[1]["tokens"] / records[1]["seconds"])
        # The trunk once per prompt token (4 prompts), the trunk and output layer per sampled token.
        tokens = statistics.median(r["tokens"] for r in records[1:])
        sizes = figures["sizes"]
        flop = 2 * sizes["trunk"] * figures["prompt_tokens"] + 2 * (sizes["trunk"] + sizes["head"]) * tokens
        assert row["floor_tokens_per_s"] == pytest.approx(tokens / (flop / (rate * 1e9)))
    ours, theirs = rows["raylign"], rows["vllm-default"]
    assert f"raylign starts {theirs['start_s'] - ours['start_s']:.1f} s sooner" in done.stdout
