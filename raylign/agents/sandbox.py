"""Run untrusted Python (a model's tool call) in a separate, confined process.

Each call starts a fresh interpreter under a sandboxing tool, in a fresh scratch directory
(its cwd and the only writable place, removed afterwards), with no network, and under
resource limits. The tools, best first, and what each isolates are in
:mod:`raylign.agents.sandbox_backends`; :func:`sandbox_backend` names the one in use.

Limits are set by a small bootstrap inside the sandbox before the code runs: RLIMIT_CPU
(SIGXCPU, then SIGKILL a second later), RLIMIT_AS (memory), RLIMIT_FSIZE (file size),
RLIMIT_NPROC (processes, counted per user namespace) and no core dumps. The parent watches
what limits per process cannot bound, every ``_WATCH_INTERVAL_S`` (or less often when a check
is slow, so that checking takes at most about 1/``_WATCH_COST_RATIO`` of a core), and kills the
sandbox past one: more than ``max_processes`` processes (the kernel never applies RLIMIT_NPROC
to uid 0), more than ``memory_mb`` resident in all its processes together (RLIMIT_AS bounds each
one only; anonymous and shared-memory pages, counted in each process that maps them, and the
memory files (``memfd_create``) they hold open, which RLIMIT_AS does not see), and, where
no size-limited tmpfs bounds it, more than ``max_disk_mb`` of files in the scratch directory.
These checks are approximate: a run may overshoot for one interval. With a pid namespace they
read the sandbox's own process tree only; without one, every process (a child that left the tree
stays in the process group or session). And more than ``max_files`` files and folders, which
take kernel memory but no space (the scratch directory walked, or the sandbox's own tmpfs mounts'
inodes in use, read through the ``/proc`` root of a process inside them). Not bounded but by the
wall time: System V shared memory that no process maps, freed with the call's IPC namespace when it
ends (the ``rlimit`` backend has none: there it outlives the call). On wall-time
expiry the whole process tree is killed; with a pid namespace the kernel kills everything in it
once its first process dies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, fields
from typing import Literal

from raylign.agents import sandbox_backends
from raylign.agents.process_tree import (
    HAS_CHILDREN_FILES,
    descendants,
    entries_on_own_mounts,
    kill_tree,
    process_tree,
    resident_bytes,
    scratch_usage,
)
from raylign.agents.sandbox_backends import (
    MIB,
    SCRATCH_IN_SANDBOX,
    Backend,
    environment,
    interpreter,
    wrapper_argv,
)

logger = logging.getLogger(__name__)

FailureKind = Literal["timeout", "cpu_time", "memory", "processes", "disk", "files", "filesystem", "network", "error"]

BOOTSTRAP_MARKER = "raylign-sandbox-bootstrap"
_CPU_MARKER = "CPU time limit exceeded"
_WATCH_INTERVAL_S = 0.02
_WATCH_COST_RATIO = 5  # a check that took t seconds waits at least 5 t for the next
_REAP_TIMEOUT_S = 5.0
_MAX_OPEN_FILES = 1024  # RLIMIT_NOFILE: the watch reads every open file of every process


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run (all must be positive)."""

    cpu_time_s: int = 5  # CPU seconds of the interpreter (RLIMIT_CPU)
    wall_time_s: float = 10.0  # wall-clock seconds before the whole process tree is killed
    memory_mb: int = 512  # MiB: the address space of each process (RLIMIT_AS), and resident in all together
    max_processes: int = 16  # processes and threads the code may run at once
    max_file_mb: int = 16  # largest file the code may write, in MiB (RLIMIT_FSIZE)
    max_disk_mb: int = 64  # MiB its files may take together in the scratch directory (and in /dev/shm)
    max_files: int = 10_000  # files and folders it may create there (empty ones take kernel memory, not space)
    max_output_chars: int = 4000  # characters of stdout and of stderr kept in the result

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{field.name} must be a positive number, got {value!r}")


@dataclass
class SandboxResult:
    """What one run produced. ``message`` is one line meant for the model to read."""

    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None  # the process's exit status; 128 + N when signal N ended it; None when killed
    failure: FailureKind | None
    message: str
    seconds: float


_BOOTSTRAP = f"""# {BOOTSTRAP_MARKER}
import linecache, os, resource, signal, sys, traceback
cpu, memory, fsize, nproc = (int(a) for a in sys.argv[1:5])
code = sys.stdin.read()
sys.stdin.close()
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # open files: the parent reads each one's kind
files = {_MAX_OPEN_FILES} if hard == resource.RLIM_INFINITY else min(hard, {_MAX_OPEN_FILES})
resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
if nproc > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
def out_of_cpu(signum, frame):
    os.write(2, b"\\n{_CPU_MARKER}\\n")
    os._exit(128 + signum)
signal.signal(signal.SIGXCPU, out_of_cpu)  # a clear message instead of a bare signal death
linecache.cache["<tool call>"] = (len(code), None, code.splitlines(True), "<tool call>")
sys.argv = ["<tool call>"]
try:
    exec(compile(code, "<tool call>", "exec"), {{"__name__": "__main__"}})
except SystemExit:
    raise
except BaseException as error:
    traceback.print_exception(type(error), error, error.__traceback__.tb_next)
    sys.exit(1)
"""


def sandbox_backend() -> str:
    """The backend runs use here: "bwrap", "unshare" or "rlimit" (see the module docstring).

    ``RAYLIGN_SANDBOX_BACKEND`` forces one (an error if it does not work here).
    """
    return sandbox_backends.chosen_backend().name


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandbox and wait for it (at most about ``limits.wall_time_s``)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python_async(code, limits))
    # Called from inside an event loop: run on a private loop in a worker thread instead.
    wall_time_s = (limits or SandboxLimits()).wall_time_s
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(asyncio.run, run_python_async(code, limits)).result(timeout=wall_time_s + 60)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(
            f"sandbox: the run gave no result within {wall_time_s + 60:g} s (its wall_time_s {wall_time_s:g} "
            "plus 60 to start and end it)"
        ) from None
    finally:
        pool.shutdown(wait=False)  # not waiting for a run that overran: that is what the limit is for


async def run_python_async(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """The coroutine form of :func:`run_python`; many may run at once without blocking the loop."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    limits = limits or SandboxLimits()
    backend = await asyncio.to_thread(sandbox_backends.chosen_backend)
    started = time.monotonic()
    scratch = await asyncio.to_thread(tempfile.mkdtemp, prefix="raylign-sandbox-")
    try:
        proc = await asyncio.create_subprocess_exec(
            *_command(backend, scratch, limits),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=scratch,
            env=environment(backend, scratch),
            start_new_session=True,  # its own process group, killed as one
        )
        killed_for, stdout, stderr = await _supervise(proc, code, backend, limits, scratch)
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)
    seconds = time.monotonic() - started
    exit_code = None if killed_for else _exit_status(proc.returncode)
    failure = killed_for or _classify(exit_code, stderr, seconds, limits)
    return SandboxResult(
        ok=failure is None,
        stdout=_truncate(*stdout, limits.max_output_chars),
        stderr=_truncate(*stderr, limits.max_output_chars),
        exit_code=exit_code,
        failure=failure,
        message=_message(failure, killed_for is not None, stderr[0], seconds, limits, exit_code),
        seconds=seconds,
    )


async def _supervise(
    proc: asyncio.subprocess.Process, code: str, backend: Backend, limits: SandboxLimits, scratch: str
) -> tuple[FailureKind | None, tuple[bytes, int], tuple[bytes, int]]:
    """Feed the code, read both streams (bounded), and kill the tree on wall time or past a watched limit."""
    keep_bytes = 4 * limits.max_output_chars  # enough for max_output_chars characters of UTF-8
    readers = [asyncio.ensure_future(_read_bounded(s, keep_bytes)) for s in (proc.stdout, proc.stderr)]
    killed_for: FailureKind | None = None
    deadline = time.monotonic() + limits.wall_time_s
    try:
        await _feed(proc, code)
        while proc.returncode is None:
            if time.monotonic() >= deadline:
                killed_for = "timeout"
                break
            checked = time.monotonic()
            if killed_for := await asyncio.to_thread(_past_limit, proc.pid, backend, limits, scratch):
                break
            interval = max(_WATCH_INTERVAL_S, _WATCH_COST_RATIO * (time.monotonic() - checked))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), min(interval, max(0.0, deadline - time.monotonic())))
    finally:
        # Always: leftovers of a finished run (background children) go too. Once reaped, proc.pid
        # may be reused by an unrelated process: then only its process group and session are ours.
        await asyncio.to_thread(kill_tree, proc.pid, proc.returncode is None)
        try:
            await asyncio.wait_for(proc.wait(), _REAP_TIMEOUT_S)
        except TimeoutError:
            logger.error(f"sandbox process {proc.pid} did not exit {_REAP_TIMEOUT_S} s after SIGKILL")
        done, pending = await asyncio.wait(readers, timeout=_REAP_TIMEOUT_S)
        for reader in pending:  # a process outside the tree still holds a pipe open
            reader.cancel()
    stdout, stderr = (r.result() if r in done and not r.cancelled() else (b"", 0) for r in readers)
    return killed_for, stdout, stderr


def _past_limit(root: int, backend: Backend, limits: SandboxLimits, scratch: str) -> FailureKind | None:
    """The limit that the running sandbox is past, if any, of those that only the parent can see."""
    processes = descendants(root) if backend.pid_namespace and HAS_CHILDREN_FILES else process_tree(root)
    if len(processes) > limits.max_processes + backend.wrapper_processes:
        return "processes"
    if resident_bytes(processes) > limits.memory_mb * MIB:
        return "memory"
    if backend.bounds_disk:  # its own tmpfs mounts, full at max_disk_mb, but not of (empty) files
        files = entries_on_own_mounts(processes, (SCRATCH_IN_SANDBOX, "/dev/shm"))
    else:
        used, files = scratch_usage(scratch)
        if used > limits.max_disk_mb * MIB:
            return "disk"
    if files is not None and files > limits.max_files:
        return "files"
    return None


async def _feed(proc: asyncio.subprocess.Process, code: str) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(code.encode())
        await asyncio.wait_for(proc.stdin.drain(), _REAP_TIMEOUT_S)
        proc.stdin.close()
    except (TimeoutError, BrokenPipeError, ConnectionResetError):
        pass  # the process died before reading its code; its exit status tells why


async def _read_bounded(stream: asyncio.StreamReader | None, keep_bytes: int) -> tuple[bytes, int]:
    """Read ``stream`` to its end, keeping the first ``keep_bytes``; returns them and the total size."""
    kept, total = bytearray(), 0
    while stream is not None and (chunk := await stream.read(1 << 16)):
        total += len(chunk)
        kept += chunk[: max(0, keep_bytes - len(kept))]
    return bytes(kept), total


def _truncate(data: bytes, total_bytes: int, max_chars: int) -> str:
    text = data.decode("utf-8", errors="replace")
    if len(text) <= max_chars and total_bytes == len(data):
        return text
    return text[:max_chars] + f"\n[output truncated: first {max_chars} characters of {total_bytes} bytes shown]"


def _exit_status(returncode: int | None) -> int | None:
    """Exit status as a shell reports it: 128 + N for signal N (bwrap reports its child's so)."""
    if returncode is None:
        return None
    return 128 - returncode if returncode < 0 else returncode


# Each kind: the exception types that name it (matched against the type only: "KeyError: 'timeout'"
# is not a network failure), and the strerror texts and errno numbers that do (anywhere).
_MEMORY = (r"MemoryError", r"Cannot allocate memory|\[Errno 12\]")
_PROCESSES = (r"BlockingIOError", r"Resource temporarily unavailable|can't start new thread|\[Errno 11\]")
_NETWORK = (
    r"ConnectionError|ConnectionRefusedError|ConnectionResetError|ConnectionAbortedError|gaierror|herror|"
    r"timeout|TimeoutError|URLError",
    r"Network is unreachable|\[Errno (97|99|101|110|111|113)\]",
)
_FILESYSTEM = (
    r"PermissionError|FileNotFoundError|NotADirectoryError|IsADirectoryError",
    r"Read-only file system|Operation not permitted|\[Errno (1|2|13|30)\]",
)
# OSError (its type names no kind): the space limits, per file (EFBIG) and in all (ENOSPC, EDQUOT).
_DISK = re.compile(r"File too large|No space left on device|Disk quota exceeded|\[Errno (27|28|122)\]")


def _error_pattern(types: str, texts: str) -> re.Pattern[str]:
    """The last line names this kind: one of ``types`` raised (``socket.timeout`` too), or ``texts`` in it."""
    return re.compile(rf"^(?:[\w.]+\.)?(?:{types})(?::|$)|{texts}")


# First match wins: a MemoryError while opening a socket is about memory.
_ERROR_PATTERNS: tuple[tuple[FailureKind, re.Pattern[str]], ...] = (
    ("memory", _error_pattern(*_MEMORY)),
    ("processes", _error_pattern(*_PROCESSES)),
    ("network", _error_pattern(*_NETWORK)),
    ("disk", _DISK),
    ("filesystem", _error_pattern(*_FILESYSTEM)),
)


def _classify(
    exit_code: int | None, stderr: tuple[bytes, int], seconds: float, limits: SandboxLimits
) -> FailureKind | None:
    """Name why a run that was not killed by the parent failed; None if it exited with status 0."""
    if exit_code == 0:
        return None
    last = _last_error_line(stderr[0].decode("utf-8", errors="replace"))
    if exit_code == 128 + signal.SIGXCPU or last == _CPU_MARKER:
        return "cpu_time"  # RLIMIT_CPU's soft limit: SIGXCPU
    if exit_code == 128 + signal.SIGKILL and seconds >= limits.cpu_time_s:
        return "cpu_time"  # its hard limit, a second later (code stuck in C ignores SIGXCPU's handler)
    for kind, pattern in _ERROR_PATTERNS:
        if pattern.search(last):
            return kind
    if exit_code == 128 + signal.SIGXFSZ:
        return "disk"
    return "error"


def _last_error_line(stderr: str) -> str:
    """The traceback's last line (the exception raised), or the last nonblank line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


_FAILURE_TEXT: dict[str, str] = {
    "timeout": "stopped: ran past the wall-time limit of {wall} s",
    "cpu_time": "stopped: used more than the CPU-time limit of {cpu} s",
    "memory": "failed: out of memory (the limit is {memory} MB for all its processes together)",
    "processes": "failed: too many processes or threads (the limit is {processes})",
    "disk": "failed: out of disk space (the limits are {file} MB per file and {disk} MB for all files together)",
    "files": "failed: too many files (the limit is {files} files and folders)",
    "filesystem": "failed: only the current directory is writable and nothing outside it is visible",
    "network": "failed: there is no network access in this sandbox",
    "error": "failed with exit code {exit_code}",
}


def _message(
    failure: FailureKind | None,
    killed: bool,
    stderr: bytes,
    seconds: float,
    limits: SandboxLimits,
    exit_code: int | None,
) -> str:
    """One line for the model; the error the code raised is added unless the parent stopped the code."""
    if failure is None:
        return f"ran in {seconds:.2f} s (exit code 0)"
    text = _FAILURE_TEXT[failure].format(
        wall=limits.wall_time_s,
        cpu=limits.cpu_time_s,
        memory=limits.memory_mb,
        processes=limits.max_processes,
        file=limits.max_file_mb,
        disk=limits.max_disk_mb,
        files=limits.max_files,
        exit_code=exit_code,
    )
    last = _last_error_line(stderr.decode("utf-8", errors="replace"))
    if killed or not last or failure in ("cpu_time", "processes"):
        return text
    return f"{text}: {last[:200]}"


def _command(backend: Backend, scratch: str, limits: SandboxLimits) -> list[str]:
    """The argv of one run: wrapper, interpreter, bootstrap and the limits it sets."""
    nproc = math.ceil(limits.max_processes) + 1 if backend.counts_own_processes else 0
    bootstrap_limits = [math.ceil(limits.cpu_time_s), limits.memory_mb * MIB, limits.max_file_mb * MIB, nproc]
    wrapper = wrapper_argv(backend, scratch, limits.max_disk_mb * MIB)
    return [*wrapper, interpreter(), "-I", "-c", _BOOTSTRAP, *(str(int(v)) for v in bootstrap_limits)]
