"""benchmarks/weight_sync.py end to end on the tiny model with the hf engine: its figures add up."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "weight_sync.py"


@pytest.mark.slow
def test_the_report_is_the_syncs_bytes_against_the_loopback_floor(tmp_path):
    report = tmp_path / "report.json"
    command = [sys.executable, str(SCRIPT), "--model", "tiny", "--engine", "hf", "--syncs", "3"]
    command += ["--dtype", "float32", "--json", str(report)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(report.read_text())
    syncs = figures["syncs"]
    assert len(syncs) == 3 and [s["engine_version"] for s in syncs] == [1, 2, 3]
    for sync in syncs:
        assert sync["num_bytes"] >= figures["num_bytes"] and sync["num_tensors"] == figures["num_tensors"]
        assert 0 <= sync["engine_waited_s"] <= sync["engine_s"] <= sync["seconds"]
    median = figures["median"]
    assert median["floor_s"] == pytest.approx(figures["num_bytes"] / (figures["machine"]["loopback_gb_s"] * 1e9))
    assert median["sync_s"] == pytest.approx(statistics.median(s["seconds"] for s in syncs[1:]))
    assert len(figures["bare_gloo_s"]) == 3 and all(s > 0 for s in figures["bare_gloo_s"])
    table = [float(x) for x in done.stdout.splitlines()[-1].split()]  # the last line: the medians
    assert table[4] == pytest.approx(median["floor_s"] / median["sync_s"], abs=1e-3)
