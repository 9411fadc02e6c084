"""What the raylign-against-TRL benchmarks share: one side per child process, medians after warm-up.

A benchmark writes its workload to ``spec.json``, runs itself again as a child with ``--side NAME
--spec spec.json``, and the child writes ``steps.json`` (``{"records": [...], ...}``) next to it.
Running each side in a fresh process keeps one side's threads, caches and allocator state out of
the other's timings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}

MATMUL_SIZES = (128, 256, 512)
ALL_CORE_SIZES = (256, 512, 1024)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve", "bf16")
DTYPE_HELP = (
    "auto (the default): bf16 where the CPU multiplies bf16 natively (AMX or AVX512-BF16), else float32, "
    "as raylign's dtype: auto decides"
)


def generation_arguments(description: str, sides: tuple[str, ...], max_new_tokens: int) -> argparse.ArgumentParser:
    """The options of a generation benchmark (model, prompts, samples, length, calls, dtype, threads,
    report, work folder) and the hidden ones its children take (``--side``, ``--spec``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model", choices=["smollm2", "tiny"], default="smollm2", help="SmolLM2-135M or a random tiny Qwen2"
    )
    parser.add_argument("--prompts", type=int, default=16, help="prompts per call")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="most tokens per sample")
    parser.add_argument("--reps", type=int, default=3, help="calls per side; the first is warm-up")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help=DTYPE_HELP)
    parser.add_argument(
        "--threads", default="all", choices=["all", "1"], help="compute threads of each side: every core, or one"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the model and logs here")
    parser.add_argument("--side", choices=sides, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def machine(dtype: str) -> dict[str, Any]:
    """What this machine can do, measured now: CPU model, instruction set, cores this process may use,
    matmul GFLOP/s at ``dtype`` on one thread (the best of square sizes 128, 256 and 512: which size runs
    fastest depends on the instruction set, e.g. bf16 without native support is fastest at 128) and on
    every core (the best of 256, 512 and 1024: threads pay off on larger products), memory-copy and
    TCP-loopback GB/s."""
    import torch

    from raylign.hardware import cpu_flags, cpu_model, matmul_gflops

    cores = len(os.sched_getaffinity(0))
    dt = getattr(torch, dtype)
    return {
        "cpu": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "flags": [f for f in ISA_FLAGS if f in cpu_flags()],
        "cores": cores,
        "matmul_gflops_1thread": max(matmul_gflops(dt, size=n, repeats=5) for n in MATMUL_SIZES),
        "matmul_gflops_all_cores": max(matmul_gflops(dt, size=n, repeats=5, threads=cores) for n in ALL_CORE_SIZES),
        "copy_gb_s": copy_gb_s(),
        "loopback_gb_s": loopback_gb_s(),
    }


def matmul_rate(hw: dict[str, Any], threads: int) -> float:
    """GFLOP/s of matmul on ``threads`` threads as measured by :func:`machine`: the one-thread rate for 1,
    the every-core rate for all cores (measured, not the one-thread rate times the cores: cores that
    work together share caches, memory bandwidth and clock headroom), in between the one-thread rate
    times ``threads``."""
    if threads == 1:
        return hw["matmul_gflops_1thread"]
    if threads >= hw["cores"]:
        return hw["matmul_gflops_all_cores"]
    return hw["matmul_gflops_1thread"] * threads


def model_matmul_gflops(
    model_path: str, dtype: str, threads: int, rows: int = 1024, repeats: int = 3
) -> dict[str, float]:
    """GFLOP/s of the model's own matrix products on ``rows`` token rows at ``dtype`` on ``threads``
    threads, best of ``repeats``: ``trunk_forward`` the seven projections of one decoder layer (q, k, v,
    o, gate, up, down: ``X W^T``), ``trunk_train`` those and both products of their backward (``dY W``,
    ``dY^T X``), ``head_forward`` and ``head_train`` the same for the output layer. The square products
    of :func:`machine` run faster than a model's narrow ones (576 wide for SmolLM2); these rates say what
    the matrix products of this model can reach here."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    trunk = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inner), (hidden, inner), (inner, hidden)]
    dt = getattr(torch, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:

        def rate(shapes: list[tuple[int, int]], backward: bool) -> float:
            tensors = [
                (torch.randn(rows, d_in).to(dt), torch.randn(d_out, d_in).to(dt), torch.randn(rows, d_out).to(dt))
                for d_in, d_out in shapes
            ]

            def products() -> None:
                for x, w, dy in tensors:
                    torch.nn.functional.linear(x, w)
                    if backward:
                        dy @ w
                        dy.t() @ x

            products()  # warm-up
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                products()
                best = min(best, time.perf_counter() - start)
            flop = sum(2 * rows * d_in * d_out for d_in, d_out in shapes) * (3 if backward else 1)
            return flop / best / 1e9

        head = [(hidden, config.vocab_size)]
        return {
            "rows": rows,
            "trunk_forward": rate(trunk, False),
            "trunk_train": rate(trunk, True),
            "head_forward": rate(head, False),
            "head_train": rate(head, True),
        }
    finally:
        torch.set_num_threads(before)


def copy_gb_s(megabytes: int = 256, repeats: int = 3) -> float:
    """Best-of-``repeats`` rate of one tensor copy (bytes copied per second, one thread), in GB/s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(megabytes << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: the pages exist
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return src.numel() / best / 1e9


def loopback_gb_s(megabytes: int = 256, timeout_s: float = 60.0) -> float:
    """Rate of ``megabytes`` sent over a TCP connection to 127.0.0.1 (the transport of the weight sync
    between processes on one machine), in GB/s."""
    payload = memoryview(bytearray(megabytes << 20))
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(timeout_s)
        sender = socket.create_connection(server.getsockname(), timeout=timeout_s)
        receiver, _ = server.accept()
    receiver.settimeout(timeout_s)
    thread = threading.Thread(target=sender.sendall, args=(payload,), daemon=True)
    buffer = memoryview(bytearray(1 << 22))
    received = 0
    with sender, receiver:
        start = time.perf_counter()
        thread.start()
        while received < len(payload):
            count = receiver.recv_into(buffer)
            if count == 0:
                raise RuntimeError(f"loopback bandwidth: the connection closed after {received} bytes")
            received += count
        elapsed = time.perf_counter() - start
        thread.join(timeout_s)
    return received / elapsed / 1e9


def launch(
    script: str,
    side: str,
    spec: dict[str, Any],
    out: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 3 * 3600,
) -> dict[str, Any]:
    """Run ``script --side side`` in a child process with ``spec`` as its workload: what the child wrote to
    ``steps.json`` plus ``wall_s``, or ``error`` (the log's last error line, or that the side ran past
    ``timeout_s`` and was stopped), ``log`` and ``wall_s``."""
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec))
    log_file = out / "run.log"
    start = time.perf_counter()
    with log_file.open("w") as log:
        child = subprocess.Popen(
            [sys.executable, script, "--side", side, "--spec", str(spec_file)],
            env={**os.environ, **CHILD_ENV, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        try:
            returncode = child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stop_child(child)
            error = f"side {side!r} ran past {timeout_s:.0f} s and was stopped"
            return {"error": error, "log": str(log_file), "wall_s": time.perf_counter() - start}
        except BaseException:  # Ctrl-C, or SIGTERM through run_benchmark's handler: the child goes too
            stop_child(child)
            raise
    wall = time.perf_counter() - start
    if returncode != 0:
        return {"error": last_error_line(log_file), "log": str(log_file), "wall_s": wall}
    return {**json.loads((out / "steps.json").read_text()), "wall_s": wall}


STOP_GRACE_S = 30.0


def stop_child(child: subprocess.Popen[bytes]) -> None:
    """End a side's child: SIGTERM first, so that it ends its Ray session (whose processes would
    otherwise outlive it), then SIGKILL after :data:`STOP_GRACE_S`."""
    child.terminate()
    try:
        child.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(STOP_GRACE_S)


def write_steps(out: Path, records: list[dict[str, float]], **extra: Any) -> None:
    """The child's side of :func:`launch`: its per-step records and anything else the driver needs."""
    (out / "steps.json").write_text(json.dumps({"records": records, **extra}))


def last_error_line(log_file: Path) -> str:
    lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return (errors or lines or ["no output"])[-1][:300]


def median_after_warmup(records: list[dict[str, float]], key: str) -> float:
    """Median of ``key`` over every step but the first (warm-up); NaN when absent."""
    values = [r[key] for r in records[1:] if key in r]
    return statistics.median(values) if values else float("nan")


def fmt(value: float, width: int = 7, digits: int = 2) -> str:
    return f"{'n/a':>{width}s}" if math.isnan(value) else f"{value:{width}.{digits}f}"


def in_workdir(workdir: Path | None, prefix: str, body: Callable[[Path], list[dict[str, Any]]]) -> None:
    """Run ``body`` (which returns the report's rows) in ``workdir``, or in a temporary folder removed
    afterwards. The folder is kept when it was given, or when a row has ``errors``: the failing side's
    log is the evidence."""
    keep = workdir is not None
    folder = workdir or Path(tempfile.mkdtemp(prefix=prefix))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        rows = body(folder)
        if any(row["errors"] for row in rows):
            keep = True
            print(f"\nlogs kept in {folder}")
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def run_benchmark(
    parse_args: Callable[[], Any],
    run_side: Callable[[str, Path], None],
    prefix: str,
    body: Callable[[Any, Path, tuple[float, ...]], list[dict[str, Any]]],
) -> None:
    """A benchmark script's entry: as a child (``--side``), run that side; otherwise run
    ``body(args, workdir, load average before)`` under :func:`in_workdir`."""
    args = parse_args()
    if args.side is not None:
        run_side(args.side, args.spec)
        return
    # A stopped driver (SIGTERM) unwinds like Ctrl-C, so :func:`launch` stops the side it runs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    load_before = os.getloadavg()
    in_workdir(args.workdir, prefix, lambda workdir: body(args, workdir, load_before))
