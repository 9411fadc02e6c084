"""What this machine computes fast, and the dtype ``auto`` picks for it.

bf16 is fast on CUDA devices that support it and on CPUs with native bf16 instructions
(Intel AMX, AVX512-BF16; ARM's BF16 extension). Elsewhere torch emulates bf16 on the CPU,
and a bf16 matmul runs tens of times slower than the same one in fp32 (0.8 against 56
GFLOP/s was measured on an AVX2-only CPU), so ``auto`` picks fp32 there.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("raylign")

# CPU feature flags (/proc/cpuinfo) that mean native bf16 matmuls.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, ARM
            return frozenset(value.split())
    return frozenset()


def flush_denormals() -> None:
    """Compute with denormal floats flushed to zero on the CPU (CPU ``generate`` and training are erratic
    and slow with them). numpy's float limits are looked up first: numpy measures them on first use, and
    with denormals flushed it would warn that the smallest subnormal is zero, in every process that later
    plots or formats an array."""
    import numpy as np

    for dtype in (np.float16, np.float32, np.float64, np.longdouble):
        np.finfo(dtype)
    torch.set_flush_denormal(True)


def name_cpu_accelerator_for_deepspeed() -> None:
    """Where torch sees no CUDA device, tell DeepSpeed the accelerator is the CPU. Where DeepSpeed is
    installed, every ``save_pretrained`` imports it (accelerate unwraps models through it), and
    unnamed it probes for accelerators and warns "Setting accelerator to CPU" in each process. The
    environment is inherited by the processes started after this (Ray's workers among them)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware"):
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class CpuBf16:
    native: bool
    reason: str  # one line, e.g. "AMX (amx_bf16)" or "AVX2 only, no AMX or AVX512-BF16"


@functools.cache
def cpu_bf16_support() -> CpuBf16:
    """Whether this CPU has native bf16 matmuls, and the evidence in one line."""
    capability = torch.backends.cpu.get_cpu_capability()
    found = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags()]
    no_cpuinfo = not cpu_flags()  # then ask torch's own detection
    if no_cpuinfo and (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()):
        found = ["torch reports AMX or AVX512-BF16"]
    if found:
        return CpuBf16(True, f"native bf16 ({', '.join(found)}; torch CPU capability {capability})")
    return CpuBf16(False, f"no native bf16 (torch CPU capability {capability}; no AMX or AVX512-BF16)")


def resolve_dtype(name: str, device: torch.device | str | None = None) -> tuple[str, str]:
    """The concrete dtype for a config dtype name on ``device`` (default: CUDA if present, else CPU),
    and the reason. Only ``auto`` is resolved; an explicit name comes back as it is."""
    if name != "auto":
        return name, "set explicitly"
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu = torch.cuda.get_device_name(index)
        if torch.cuda.is_bf16_supported():
            return "bfloat16", f"{gpu} supports bf16"
        return "float32", f"{gpu} has no bf16 support"
    support = cpu_bf16_support()
    return ("bfloat16" if support.native else "float32"), f"CPU {cpu_model()}: {support.reason}"


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


_logged: set[tuple[str, str, str]] = set()


def resolve_and_log(name: str, what: str, device: torch.device | str | None = None) -> str:
    """:func:`resolve_dtype`, logging the choice once per process (and warning, once, about an explicit
    bf16 on a CPU without native bf16, with the slowdown measured here)."""
    device = torch.device(device) if device is not None else default_device()
    dtype, reason = resolve_dtype(name, device)
    key = (what, name, dtype)
    if key in _logged:
        return dtype
    _logged.add(key)
    if name == "auto":
        log.info("%s dtype: auto -> %s (%s)", what, dtype, reason)
    elif dtype == "bfloat16" and device.type == "cpu" and not cpu_bf16_support().native:
        factor = measure_bf16_slowdown()
        log.warning(
            "%s dtype: bfloat16 on a CPU without native bf16 (%s): a bf16 matmul runs %.0fx slower "
            "than fp32 here; dtype 'auto' (or float32) avoids that",
            what,
            cpu_bf16_support().reason,
            factor,
        )
    return dtype


@functools.cache
def measure_bf16_slowdown(size: int = 256, repeats: int = 3) -> float:
    """How many times slower a ``size``x``size`` matmul runs in bf16 than in fp32 on this CPU (one thread)."""
    return matmul_gflops(torch.float32, size, repeats) / matmul_gflops(torch.bfloat16, size, repeats)


def matmul_gflops(dtype: torch.dtype, size: int = 256, repeats: int = 3, threads: int = 1) -> float:
    """Best-of-``repeats`` GFLOP/s of one ``size``x``size`` matmul on the CPU, on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * size**3 / best / 1e9
