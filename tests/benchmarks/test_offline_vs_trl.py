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
def test_table_prints_each_trainers_figures_and_their_ratios_as_measured(tiny_run):
    """Each printed figure is the run's own (its JSON), to the digits printed; the ratio columns are the
    quotients of the step times printed beside them."""
    stdout, report, _ = tiny_run
    assert "CPU: " in stdout and "failed" not in stdout
    for row in report["rows"]:
        (line,) = [line for line in stdout.splitlines() if line.startswith(f"{row['trainer']} ")]
        printed = [float(x) for x in line.split()[1:]]
        ray, trl, floor = row["raylign"], row["trl"], row["floor_s"]
        assert row["ratio"] == trl["step_s"] / ray["step_s"]
        expected = [
            (ray["step_s"], 3),
            (trl["step_s"], 3),
            (ray["tokens_per_s"], 0),
            (trl["tokens_per_s"], 0),
            (trl["step_s"] / ray["step_s"], 2),
            (row["tokens_per_step"], 0),
            (row["gflop_per_step"], 3),
            (floor, 4),
            (ray["step_s"] / floor, 1),
            (trl["step_s"] / floor, 1),
        ]
        assert len(printed) == len(expected) and all(x > 0 for x in printed), line
        for got, (value, digits) in zip(printed, expected, strict=True):
            assert abs(got - value) <= 0.5 * 10**-digits + 1e-9, (line, value)


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


@pytest.mark.slow
def test_dpo_flop_per_step_counts_the_policys_two_passes_and_the_live_references_forward(tiny_run):
    """8 x parameters x tokens: forward and backward (6) plus the reference's forward (2) over each pair's
    prompt twice, its chosen and its rejected answer, each answer ending in eos."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, report, workdir = tiny_run
    model_dir = workdir / "tiny-model"
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rows = [json.loads(line) for line in (workdir / "dpo.jsonl").read_text().splitlines()][BATCH : 2 * BATCH]
    tokens = sum(2 * count(r["prompt"]) + count(r["chosen"]) + 1 + count(r["rejected"]) + 1 for r in rows)
    (dpo,) = [row for row in report["rows"] if row["trainer"] == "dpo"]
    assert dpo["tokens_per_step"] == tokens
    assert dpo["gflop_per_step"] * 1e9 == pytest.approx(8 * params * tokens, rel=1e-9)
    assert dpo["floor_s"] == pytest.approx(dpo["gflop_per_step"] / report["machine"]["matmul_gflops_1thread"], rel=1e-9)
