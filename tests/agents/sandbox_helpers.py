"""What the sandbox tests look for on the host: the processes a sandboxed run started."""

from __future__ import annotations

import os
from pathlib import Path

from raylign.agents.sandbox import BOOTSTRAP_MARKER


def sandbox_processes() -> list[int]:
    """Pids of processes started by this test process's sandboxed runs (their command line holds the
    bootstrap). Under xdist another worker runs sandboxes at the same time: a process whose parents
    lead to a sibling worker (a child of the same controller) is that worker's and left out; one
    orphaned on the way up to init is counted, as a run of this process may have left it."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if BOOTSTRAP_MARKER.encode() in cmdline.read():
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return [pid for pid in pids if not _of_a_sibling_worker(pid)]


def _of_a_sibling_worker(pid: int) -> bool:
    me, controller = os.getpid(), os.getppid()
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        if pid == me:
            return False
        parent = _parent(pid)
        if parent == controller and controller > 1:
            return True
        pid = parent
    return False


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0  # exited meanwhile


def scratch_dirs(parent: Path) -> set[Path]:
    return set(parent.glob("raylign-sandbox-*"))
