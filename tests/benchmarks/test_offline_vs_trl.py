"""benchmarks/offline_vs_trl.py end to end on the tiny model: both trainers, both sides, and the floor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "offline_vs_trl.py"
BATCH = 4


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[str, dict, Path]:
    """Two steps of each trainer on each side (step 2 is timed): the printed report, its JSON, the workdir."""
    tmp = tmp_path_factory.mktemp("offline_vs_trl")
    workdir, report = tmp / "work", tmp / "report.json"
    command = [sys.executable, str(SCRIPT), "--model", "tiny", "--steps", "2", "--batch-size", str(BATCH)]
    command += ["--max-length", "48", "--workdir", str(workdir), "--json", str(report)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=1100, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads(report.read_text()), workdir


@pytest.mark.slow
def test_table_has_both_trainers_with_positive_figures(tiny_run):
    stdout, _, _ = tiny_run
    assert "CPU: " in stdout and "failed" not in stdout
    for trainer in ("sft", "dpo"):
        (line,) = [line for line in stdout.splitlines() if line.startswith(f"{trainer} ")]
        figures = [float(x) for x in line.split()[1:]]
        assert len(figures) == 10 and all(x > 0 for x in figures), line


@pytest.mark.slow
def test_sft_flop_per_step_is_six_x_parameters_x_tokens_of_the_timed_step(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, report, workdir = tiny_run
    model_dir = workdir / "tiny-model"
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Unshuffled, so the timed step 2 trains rows 4..7; a sample is its prompt and answer, then eos.
    rows = [json.loads(line) for line in (workdir / "sft.jsonl").read_text().splitlines()][BATCH : 2 * BATCH]
    tokens = sum(len(tokenizer(r["prompt"] + r["completion"])["input_ids"]) + 1 for r in rows)
    (sft,) = [row for row in report["rows"] if row["trainer"] == "sft"]
    assert sft["gflop_per_step"] * 1e9 == pytest.approx(6 * params * tokens, rel=1e-9)
    assert sft["same_tokens"]
    # One thread per process (the default): the floor is at the one-thread rate measured in the run.
    machine = report["machine"]
    assert sft["floor_s"] == pytest.approx(sft["gflop_per_step"] / machine["matmul_gflops_1thread"], rel=1e-9)
    assert machine["matmul_gflops_all_cores"] > 0
