"""``dtype: auto``: bf16 only where this machine computes it natively, fp32 elsewhere."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raylign import hardware
from raylign.config.model import ModelConfig
from raylign.config.rollout import RolloutConfig
from raylign.rollout.vllm_engine import build_llm_kwargs, cpu_kv_cache_bytes, kv_bytes_per_token


def flags_from_proc_cpuinfo() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    line = next(line for line in text.splitlines() if line.startswith(("flags", "Features")))
    return set(line.split(":", 1)[1].split())


needs_proc_cpuinfo = pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads /proc/cpuinfo")


@needs_proc_cpuinfo
def test_auto_on_this_cpu_follows_its_bf16_instructions():
    native = bool(flags_from_proc_cpuinfo() & {"amx_bf16", "avx512_bf16", "bf16"})
    dtype, reason = hardware.resolve_dtype("auto", "cpu")
    assert dtype == ("bfloat16" if native else "float32")
    assert torch.backends.cpu.get_cpu_capability() in reason
    assert ("native bf16" in reason) and (("no native bf16" in reason) == (not native))


def test_explicit_dtypes_are_kept():
    assert hardware.resolve_dtype("float32", "cpu") == ("float32", "set explicitly")
    assert hardware.resolve_dtype("bfloat16", "cpu") == ("bfloat16", "set explicitly")


def test_auto_is_the_default_for_models_and_engines():
    assert ModelConfig(path="x").dtype == "auto"
    assert RolloutConfig().dtype == "auto"


@needs_proc_cpuinfo
def test_auto_model_loads_in_the_resolved_dtype(tmp_path):
    from raylign.models import load_causal_lm
    from raylign.models.tiny import build_tiny_model

    expected = torch.bfloat16 if flags_from_proc_cpuinfo() & {"amx_bf16", "avx512_bf16", "bf16"} else torch.float32
    model = load_causal_lm(ModelConfig(path=str(build_tiny_model(tmp_path / "m", hidden_size=32, num_heads=2))))
    assert {p.dtype for p in model.parameters()} == {expected}


def test_explicit_bf16_on_a_cpu_without_it_warns_once_with_the_measured_factor(caplog):
    if hardware.cpu_bf16_support().native:
        pytest.skip("this CPU computes bf16 natively")
    hardware._logged.clear()
    with caplog.at_level(logging.WARNING, logger="raylign"):
        assert hardware.resolve_and_log("bfloat16", "test model", "cpu") == "bfloat16"
        assert hardware.resolve_and_log("bfloat16", "test model", "cpu") == "bfloat16"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    factor = hardware.measure_bf16_slowdown()
    assert factor > 1 and f"{factor:.0f}x slower" in warnings[0]


def test_kv_cache_follows_dtype_and_max_model_len(tmp_path):
    from raylign.models.tiny import build_tiny_model

    # 2 layers x 2 KV heads x head size 16 (hidden 64 / 4 heads), keys and values.
    model = str(build_tiny_model(tmp_path / "m", hidden_size=64, num_heads=4, num_kv_heads=2))
    assert kv_bytes_per_token(model, "float32") == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(model, "bfloat16") == 2 * 2 * 2 * 16 * 2
    # 512 B/token: 64 sequences of 1000 tokens (1008 in 16-token blocks) are 32 MiB, below the 256 MiB floor.
    assert cpu_kv_cache_bytes(model, "float32", 1000) == 256 << 20
    kwargs = build_llm_kwargs(model, RolloutConfig(dtype="float32", max_model_len=100_000), on_cpu=True)
    assert kwargs["kv_cache_memory_bytes"] == min(64 * 512 * 100_000, hardware_memory() // 16)
    assert kwargs["dtype"] == "float32" and kwargs["max_model_len"] == 100_000


def hardware_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def test_flushing_denormals_leaves_numpy_silent_and_flushes():
    # In a fresh process, with warnings as errors: numpy's float limits (which plots and array printing
    # look up) after flush_denormals, and a denormal that becomes zero. The control, flushing with torch
    # directly, shows the warning this avoids.
    script = (
        "import numpy as np, torch\n"
        "from raylign.hardware import flush_denormals\n"
        "flush_denormals()\n"
        "str(np.finfo(np.float32)); str(np.finfo(np.float64))\n"
        "assert torch.tensor([1e-40], dtype=torch.float32).item() == 0.0\n"
    )
    control = "import numpy as np, torch\ntorch.set_flush_denormal(True)\nstr(np.finfo(np.float32))\n"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = [sys.executable, "-W", "error::UserWarning", "-c"]
    done = subprocess.run([*run, script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    failed = subprocess.run([*run, control], capture_output=True, text=True, timeout=120, env=env)
    assert failed.returncode != 0 and "smallest subnormal" in failed.stderr
