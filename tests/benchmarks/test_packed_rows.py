"""benchmarks/packed_rows.py on a tiny model: the one-row layout carries no padding, the rows layout does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from raylign.models.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "packed_rows.py"


def test_one_row_holds_exactly_the_real_tokens(tmp_path):
    folder = build_tiny_model(tmp_path / "tiny", arch="qwen2")
    command = [sys.executable, str(SCRIPT), "--model", str(folder), "--dtype", "float32", "--repeats", "1"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    real = int(re.search(r"(\d+) real tokens", done.stdout).group(1))
    table = {line[:24].strip(): line[24:].split() for line in done.stdout.splitlines()[-3:]}
    assert set(table) == {"sdpa, rows", "raylign_sdpa, rows", "raylign_sdpa, one row"}
    assert int(table["raylign_sdpa, one row"][0]) == real
    assert int(table["sdpa, rows"][0]) == int(table["raylign_sdpa, rows"][0]) > real
