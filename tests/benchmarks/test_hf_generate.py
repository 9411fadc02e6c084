"""benchmarks/hf_generate.py end to end on the tiny model: both sides sample, and the figures add up."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "hf_generate.py"


@pytest.mark.slow
def test_each_side_is_timed_against_the_matrix_products_of_its_positions(tmp_path):
    report = tmp_path / "report.json"
    command = [sys.executable, str(SCRIPT), "--model", "tiny", "--prompts", "4", "--n", "2"]
    command += ["--max-new-tokens", "8", "--reps", "2", "--dtype", "float32", "--json", str(report)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(report.read_text())
    rows = {row["side"]: row for row in figures["rows"]}
    assert set(rows) == {"raylign", "transformers"} and not any(row["errors"] for row in rows.values())
    sizes, width = figures["sizes"], figures["width"]
    # --threads all: every core this process may use (one per xdist worker in the suite), at the rate
    # measured on that many threads.
    hw = figures["machine"]
    assert figures["threads"] == hw["cores"]
    rate = hw["matmul_gflops_1thread"] if hw["cores"] == 1 else hw["matmul_gflops_all_cores"]
    for row in rows.values():
        records = row["records"]
        assert len(records) == 2
        for r in records:
            assert 1 <= r["steps"] <= 8 and 4 * 2 <= r["tokens"] <= 4 * 2 * r["steps"]
        assert row["seconds"] == pytest.approx(statistics.median(r["seconds"] for r in records[1:]))
        assert row["tokens_per_s"] == pytest.approx(records[1]["tokens"] / records[1]["seconds"])
        # 8 rows; the trunk at the prompt width plus every step, the output layer at every step.
        steps = records[1]["steps"]
        flop = 2 * sizes["trunk"] * 8 * (width + steps) + 2 * sizes["head"] * 8 * steps
        assert row["floor_s"] == pytest.approx(flop / (rate * 1e9))
    assert (
        f"raylign / transformers tokens/s: {rows['raylign']['tokens_per_s'] / rows['transformers']['tokens_per_s']:.2f}"
        in done.stdout
    )
