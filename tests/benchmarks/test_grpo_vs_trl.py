"""benchmarks/grpo_vs_trl.py: the floor of each phase, by hand, the workloads, and the report end to end
(raylign and bare vLLM; TRL's side is the same child-process glue as offline_vs_trl's)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from raylign.models.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "grpo_vs_trl.py"
sys.path.insert(0, str(REPO / "benchmarks"))

import grpo_vs_trl  # noqa: E402


def test_phase_floors_by_hand():
    """trunk 1000, head 200, 1400 weights in all at 4 bytes; 4 samples of 5 prompt and 10 response
    tokens (longest 16); matmul 1 GFLOP/s on one thread and 1.6 (not 2) on both cores, copy 1 GB/s,
    loopback 2 GB/s. One forward: 2 (1000 x 60 + 200 x 40) = 136000 FLOP = 85 us at 1.6 GFLOP/s;
    decoding reads 16 x 5600 bytes = 89.6 us at 1 GB/s, which is the larger; sync 5600 bytes / 2 GB/s
    = 2.8 us. On one thread the forward takes 136 us."""
    sizes = {"trunk": 1000, "head": 200, "total": 1400}
    side = {"response_length": 10.0, "response_length_max": 16.0, "sync_bytes": 5600.0}
    hw = {"cores": 2, "matmul_gflops_1thread": 1.0, "matmul_gflops_all_cores": 1.6, "copy_gb_s": 1.0}
    hw["loopback_gb_s"] = 2.0
    floors = grpo_vs_trl.phase_floors(sizes, side, 5.0, 4, True, hw, 2, 4)
    assert floors["generate"] == pytest.approx(89.6e-6)
    assert floors["experience"] == pytest.approx(85e-6)
    assert floors["train"] == pytest.approx(3 * 85e-6)
    assert floors["sync"] == pytest.approx(2.8e-6)
    one_thread = grpo_vs_trl.phase_floors(sizes, side, 5.0, 4, True, hw, 1, 4)
    assert one_thread["experience"] == pytest.approx(136e-6) and one_thread["generate"] == pytest.approx(136e-6)
    without_kl = grpo_vs_trl.phase_floors(sizes, side, 5.0, 4, False, hw, 2, 4)
    assert without_kl["experience"] == 0.0
    early = grpo_vs_trl.phase_floors(sizes, side, 5.0, 4, True, hw, 2, 4, reference_early=True)
    assert math.isnan(early["experience"]) and early["train"] == floors["train"]


def test_the_bound_on_the_ratio_adds_up_raylign_s_floors_against_trl_s_measured_step(capsys):
    """Floors 2 + 1.5 + 5 + 0.5 s, reward measured 0.25 s: 9.25 s at best against TRL's 18.5 s a step, so
    raylign can be at most 2.00x ahead; with the experience floor undefined (early reference) it counts 0.
    The workers computed 2 of the experience phase's 2.5 s (0.80) and 6.5 of the train phase's 7 (0.93)."""
    measured = {"generate": 4.0, "reward": 0.25, "experience": 2.5, "train": 7.0, "sync": 1.5}
    measured |= {"experience_compute": 2.0, "train_compute": 6.5}
    floors = {"generate": 2.0, "reward": float("nan"), "experience": 1.5, "train": 5.0, "sync": 0.5}
    assert grpo_vs_trl.step_at_floors(measured, floors) == pytest.approx(9.25)
    assert grpo_vs_trl.step_at_floors(measured, {**floors, "experience": float("nan")}) == pytest.approx(7.75)
    hw = {"cpu": "test CPU", "capability": "AVX2", "flags": ["avx2"], "cores": 2, "copy_gb_s": 8.0}
    hw |= {"matmul_gflops_1thread": 80.0, "matmul_gflops_all_cores": 150.0, "loopback_gb_s": 3.5}
    row = {"model": "smollm2", "machine": hw, "threads_used": 2, "raylign": measured, "trl": {"step_s": 18.5}}
    row["floors"] = {"raylign": floors, "trl": {**floors, "sync": float("nan")}}
    row["trl"] |= {phase: 1.0 for phase in grpo_vs_trl.PHASES}
    args = grpo_vs_trl.parse_args(["--threads", "default", "--dtype", "float32"])
    grpo_vs_trl.print_floors([row], args)
    lines = [line.split() for line in capsys.readouterr().out.strip().splitlines()]
    assert lines[-1] == ["smollm2", "9.25", "18.50", "2.00"]
    assert ["smollm2", "experience", "2.50", "2.00", "0.80"] in lines
    assert ["smollm2", "train", "7.00", "6.50", "0.93"] in lines


def test_the_ratio_per_flop_divides_each_side_s_step_by_its_own_work():
    """TRL 30 s a step with a train floor of 6 s (its step's work), raylign 10 s with 4 s: 3x per step,
    but TRL's step did 1.5x the work, so 2x at equal work."""
    row = {"raylign": {"step_s": 10.0}, "trl": {"step_s": 30.0}}
    row["floors"] = {"raylign": {"train": 4.0}, "trl": {"train": 6.0}}
    assert grpo_vs_trl.ratio_per_flop(row) == pytest.approx(2.0)


def test_the_dtype_defaults_to_bf16_only_where_the_cpu_multiplies_bf16_natively():
    """x86: AMX or AVX512-BF16; ARM: the bf16 feature (the flags /proc/cpuinfo lists)."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            flags |= set(line.partition(":")[2].split())
    native = bool(flags & {"amx_bf16", "avx512_bf16", "bf16"})
    assert grpo_vs_trl.parse_args([]).dtype == ("bfloat16" if native else "float32")
    assert grpo_vs_trl.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    assert grpo_vs_trl.parse_args(["--dtype", "float32"]).dtype_reason == "set explicitly"


@pytest.mark.parametrize("tied", [True, False])
def test_model_sizes_split_the_weights_into_trunk_and_output_layer(tmp_path, tied):
    path = build_tiny_model(tmp_path / "m", hidden_size=64, num_heads=2, num_kv_heads=1, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trunk = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    vocab = model.config.vocab_size
    sizes = grpo_vs_trl.model_sizes(str(path))
    assert sizes == {"total": sum(p.numel() for p in model.parameters()), "head": vocab * 64, "trunk": trunk}


def test_gsm_task_takes_the_word_problems_in_turn_and_trl_scores_them_with_math_verify(tmp_path):
    path = grpo_vs_trl.write_prompts(tmp_path / "p.jsonl", 52, task="gsm")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    problems = [json.loads(line) for line in grpo_vs_trl.GSM_PROMPTS.read_text().splitlines()]
    assert len(rows) == 52 and len(problems) == 50
    assert rows[0]["prompt"] == problems[0]["prompt"] and rows[50] == {k: problems[0][k] for k in ("prompt", "label")}
    completions = [[{"role": "assistant", "content": "so \\boxed{285}"}], [{"role": "assistant", "content": "284"}]]
    assert grpo_vs_trl.math_for_trl(None, completions, ["285", "285"]) == [1.0, 0.0]


@pytest.mark.slow
def test_report_prints_every_phase_against_its_floor(tmp_path):
    command = [sys.executable, str(SCRIPT), "--engine", "hf", "--skip-trl", "--steps", "2"]
    command += ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--workdir", str(tmp_path)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = done.stdout.split("Where the time goes")[1]
    assert "GFLOP/s" in report and "GB/s" in report
    rows = {line.split()[2]: line.split()[3:] for line in report.splitlines() if line.startswith("tiny     raylign")}
    assert sorted(rows) == sorted(grpo_vs_trl.PHASES)
    for phase in ("generate", "train", "sync"):
        measured, floor, share = (float(x) for x in rows[phase])
        assert measured > 0 and floor >= 0 and 0 <= share <= 1, (phase, rows[phase])
        # floor / measured, from the unrounded figures: within what the printed ones (to 0.01 s and 0.001 s) allow
        lowest = max(floor - 5e-4, 0.0) / (measured + 5e-3)
        highest = (floor + 5e-4) / max(measured - 5e-3, 1e-9)
        assert lowest - 5e-3 <= share <= highest + 5e-3, (phase, rows[phase])
    # the reference passes ran as the groups finished generating (raylign's auto with --threads 1, the default)
    assert float(rows["experience"][0]) > 0 and rows["experience"][1:] == ["n/a", "n/a"]
    # the workers' own compute within the phases on them: the update inside the train phase; the experience
    # phase has no pass left (the reference passes ran beside generation), so they computed nothing there
    computing = {line.split()[1]: line.split()[2:] for line in report.splitlines() if line.startswith("tiny     ")}
    measured, computed, share = (float(x) for x in computing["train"])
    # printed to 0.01 s, and the tiny model's update takes about that: the share is checked on the unrounded
    # figures (which test_the_bound_on_the_ratio_adds_up... checks by hand)
    assert 0 < share <= 1 and computed <= measured + 0.01
    assert float(computing["experience"][1]) == 0.0
    generation = report.split("raylign/bare")[1].splitlines()[1].split()
    raylign_tok_s, trl_tok_s, bare_tok_s, ratio = generation[1:]
    assert trl_tok_s == "n/a" and float(raylign_tok_s) > 0 and float(bare_tok_s) > 0
    assert float(ratio) == pytest.approx(float(raylign_tok_s) / float(bare_tok_s), abs=0.01)
