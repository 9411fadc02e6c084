"""All backends train alike, survive a crash mid-save, and export loadable models.

``engine_worker.py`` runs twice in real processes: a run that crashes while saving step 3's
checkpoint (``os._exit``), then a run that trains 3 steps uninterrupted (the reference),
exports it, and resumes the crashed run from its newest complete checkpoint. ``local`` runs
alone; fsdp2, ZeRO-2 and ZeRO-3 (plain and with CPU offload) run one after the other on 2
gloo ranks started by ``torch.distributed.run``, so the whole module costs four launches.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .engine_testing import assert_export_loads_and_generates

WORKER = Path(__file__).with_name("engine_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS, CRASH_AFTER = 3, 2
CRASH_EXIT_CODE = 17  # engine_worker.CRASH_EXIT_CODE
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NEEDS_DEEPSPEED = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (optional extra)")
# engine_worker.RUNS: fsdp2 and DeepSpeed ZeRO-2/3, plain and with parameters and optimizer on
# the CPU (FSDP2's CPUOffloadPolicy; ZeRO-3 offload with DeepSpeedCPUAdam).
FSDP2_RUNS = ["fsdp2", "fsdp2_offload"]
DEEPSPEED_RUNS = ["zero2", "zero3", "zero3_offload"]
SHARDED_RUNS = FSDP2_RUNS + (DEEPSPEED_RUNS if HAS_DEEPSPEED else [])
RUN_PARAMS = FSDP2_RUNS + [pytest.param(run, marks=NEEDS_DEEPSPEED) for run in DEEPSPEED_RUNS]

# Cross-backend agreement. Everything is fp32 and the math is the same; only the order of
# reductions differs (a rank's matmuls see 2 of the 4 sequences, gradients are summed across
# ranks by a collective, ZeRO flattens parameters). Each such difference is ~1e-7 relative; over
# 5 AdamW steps the measured gaps are <= 1e-7 relative for losses and <= 4e-7 for gradient norms,
# so 1e-5 leaves a wide margin. A real fault is far larger: a dropped micro-batch or gradients
# summed instead of averaged across ranks moves the gradient norm by 30% or more.
LOSS_RTOL = 1e-5
# Weights after 5 steps: AdamW normalises each coordinate, so where a gradient is near zero the
# ~1e-7 differences can move that coordinate's update by up to a fraction of lr (1e-2); the
# measured maximum is 4e-6.
WEIGHT_ATOL = 1e-4


def launch(runs: list[str], mode: str, out: Path, model_dir: Path, nproc: int) -> subprocess.CompletedProcess:
    worker_args = [
        str(WORKER), "--runs", ",".join(runs), "--mode", mode, "--model-dir", str(model_dir), "--out", str(out),
        "--steps", str(STEPS), "--crash-after", str(CRASH_AFTER),
    ]  # fmt: skip
    if nproc == 1:
        command = [sys.executable, *worker_args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        command += worker_args
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)


def crash_then_resume(runs: list[str], model_dir: Path, out: Path, nproc: int) -> dict[str, dict]:
    """Both launches; returns each run's result with its weights loaded."""
    crashed = launch(runs, "crash", out, model_dir, nproc)
    # Every rank died by the worker's os._exit(CRASH_EXIT_CODE), not by an exception.
    if nproc == 1:
        assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-4000:]
    else:
        assert crashed.stderr.count(f"exitcode  : {CRASH_EXIT_CODE}") == nproc, crashed.stderr[-4000:]
    for run in runs:
        crash_root = out / run / "crash_ckpt"
        interrupted = f".step_{CRASH_AFTER + 1}.tmp"
        assert {p.name for p in crash_root.iterdir()} == {"step_1", "step_2", interrupted}, run
        assert not (crash_root / interrupted / "COMPLETE").exists()
    finished = launch(runs, "resume", out, model_dir, nproc)
    assert finished.returncode == 0, finished.stderr[-6000:]
    results = {}
    for run in runs:
        result = json.loads((out / run / "result.json").read_text())
        result["reference_weights"] = torch.load(out / run / "reference_weights.pt")
        result["resumed_weights"] = torch.load(out / run / "resumed_weights.pt")
        result["streamed"] = torch.load(out / run / "streamed_weights.pt")
        result["every_rank"] = torch.load(out / run / "every_rank_streamed_weights.pt")
        result["export"] = out / run / "export"
        results[run] = result
    return results


def assert_resume_matches_uninterrupted(result: dict) -> None:
    assert result["resumed_from_step"] == CRASH_AFTER  # the half-written step 3 was ignored
    # Same losses, norms, learning rates and random draws (python, numpy, torch) after the resume.
    assert result["resumed"] == result["reference"][CRASH_AFTER:]
    reference, resumed = result["reference_weights"], result["resumed_weights"]
    assert reference.keys() == resumed.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(resumed[name], tensor, atol=1e-7, rtol=0, msg=name)
    assert result["reference_checkpoints"] == ["step_2", "step_3"]  # keep_last=2


def assert_agrees_with_local(result: dict, local: dict) -> None:
    assert result["world_size"] == 2
    for ours, theirs in zip(result["reference"], local["reference"], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=LOSS_RTOL), ours["step"]
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=LOSS_RTOL), ours["step"]
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-12), ours["step"]
    for name, tensor in local["reference_weights"].items():
        torch.testing.assert_close(result["reference_weights"][name], tensor, atol=WEIGHT_ATOL, rtol=0, msg=name)


@pytest.fixture(scope="module")
def local_result(tiny_model_dir, tmp_path_factory) -> dict:
    return crash_then_resume(["local"], tiny_model_dir, tmp_path_factory.mktemp("local"), nproc=1)["local"]


@pytest.fixture(scope="module")
def sharded_results(tiny_model_dir, tmp_path_factory) -> dict[str, dict]:
    """All sharded runs on 2 gloo ranks, one after the other (two launches in all)."""
    return crash_then_resume(SHARDED_RUNS, tiny_model_dir, tmp_path_factory.mktemp("sharded"), nproc=2)


@pytest.mark.slow
def test_local_resume_after_crash_matches_uninterrupted_run(local_result):
    assert local_result["world_size"] == 1
    assert_resume_matches_uninterrupted(local_result)
    for name, tensor in local_result["reference_weights"].items():  # bitwise in one process
        assert torch.equal(local_result["resumed_weights"][name], tensor), name
    assert all(math.isfinite(r["loss"]) for r in local_result["reference"])
    assert_export_loads_and_generates(local_result["export"], local_result["reference_weights"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", RUN_PARAMS)
def test_sharded_backend_trains_like_local(run, sharded_results, local_result):
    assert_agrees_with_local(sharded_results[run], local_result)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", RUN_PARAMS)
def test_sharded_backend_resume_after_crash_matches_uninterrupted_run(run, sharded_results):
    assert_resume_matches_uninterrupted(sharded_results[run])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", RUN_PARAMS)
def test_sharded_backend_export_reloads_and_generates(run, sharded_results, local_result):
    result = sharded_results[run]
    assert_export_loads_and_generates(result["export"], result["reference_weights"])
    # The gathered weights are the trained ones: they match the single-process run's.
    assert_export_loads_and_generates(result["export"], local_result["reference_weights"], atol=WEIGHT_ATOL)


def assert_stream_is_the_full_state(result: dict, model_dir: Path, streamed: dict | None = None) -> None:
    """The weight-sync stream (rank 0's unless ``streamed``) holds the full state's tensors, in its
    order, bitwise, less a tied head."""
    from transformers import AutoConfig

    full, streamed = result["reference_weights"], streamed or result["streamed"]
    tied = AutoConfig.from_pretrained(model_dir).tie_word_embeddings
    expected = [name for name in full if not (tied and name == "lm_head.weight")]
    assert streamed["names"] == expected
    for name in expected:
        assert torch.equal(streamed["tensors"][name], full[name]), name


@pytest.mark.slow
def test_local_weight_stream_is_the_full_state(local_result, tiny_model_dir):
    assert_stream_is_the_full_state(local_result, tiny_model_dir)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", RUN_PARAMS)
def test_sharded_weight_stream_is_the_full_state(run, sharded_results, tiny_model_dir):
    assert_stream_is_the_full_state(sharded_results[run], tiny_model_dir)
    # Handed out one tensor at a time (FSDP2 gathers one parameter, ZeRO-3 one submodule, at a time):
    # rank 0 never held two of the stream's tensors at once.
    assert sharded_results[run]["streamed"]["held_at_once"] == 1


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", RUN_PARAMS)
def test_every_rank_streams_the_full_state_for_colocated_engines(run, sharded_results, tiny_model_dir):
    """What colocated engines load: rank 1 gets the same stream as rank 0, one tensor at a time; and
    the default whole-model gather, broadcast from rank 0 a tensor at a time, gives it the same."""
    every_rank = sharded_results[run]["every_rank"]
    assert_stream_is_the_full_state(sharded_results[run], tiny_model_dir, every_rank["stream"])
    assert every_rank["stream"]["held_at_once"] == 1
    assert_stream_is_the_full_state(sharded_results[run], tiny_model_dir, every_rank["broadcast"])
