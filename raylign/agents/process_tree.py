"""The processes of one sandboxed run, read from ``/proc``: which they are, the memory they hold,
the disk their files take, and killing them all. :mod:`raylign.agents.sandbox` watches with these."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable

logger = logging.getLogger(__name__)

KILL_TIMEOUT_S = 5.0


def process_tree(root: int, include_root: bool = True) -> set[int]:
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
HAS_CHILDREN_FILES = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def descendants(root: int) -> set[int]:
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


def resident_bytes(pids: set[int]) -> int:
    """Memory resident in ``pids`` that they hold themselves: anonymous and shared-memory pages, not
    files', and memory files (``memfd_create``) they hold open, once each, which no process need map:
    a memfd's pages, mapped too, count in both."""
    total, memory_files = 0, {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith(("RssAnon:", "RssShmem:")):
                        total += int(line.split()[1]) * 1024  # in kB
            fds = os.listdir(f"/proc/{pid}/fd")
        except (OSError, ValueError):
            continue
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if os.readlink(path).startswith("/memfd:"):
                    st = os.stat(path)
                    memory_files[(st.st_dev, st.st_ino)] = st.st_blocks * 512
            except OSError:  # closed meanwhile
                continue
    return total + sum(memory_files.values())


def scratch_usage(directory: str) -> tuple[int, int]:
    """Bytes of disk that the files and folders under ``directory`` take (allocated blocks, not
    sizes), and how many there are."""
    total, count, stack = 0, 0, [directory]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    count += 1
                    with contextlib.suppress(OSError):
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
        except OSError:
            continue
    return total, count


def entries_on_own_mounts(processes: Iterable[int], mounts: tuple[str, ...]) -> int | None:
    """Files and folders on the filesystems mounted at ``mounts`` as a process of ``processes`` in a
    mount namespace of its own sees them (a sandbox's tmpfs), read through that process's ``/proc``
    root: each mount's inodes in use, less its root folder. None when no such process can be read."""
    own = os.readlink("/proc/self/ns/mnt")
    for pid in processes:
        try:
            if os.readlink(f"/proc/{pid}/ns/mnt") == own:
                continue  # a process outside the sandbox (its wrapper), which sees the host's mounts
            used = [os.statvfs(f"/proc/{pid}/root{mount}") for mount in mounts]
        except PermissionError as err:
            if not _UNREADABLE_MOUNTS_LOGGED:
                _UNREADABLE_MOUNTS_LOGGED.append(pid)
                logger.warning("sandbox files are not counted: its mounts cannot be read here (%s)", err)
            continue
        except OSError:  # gone
            continue
        return sum(st.f_files - st.f_ffree - 1 for st in used)
    return None


_UNREADABLE_MOUNTS_LOGGED: list[int] = []  # once per process


def kill_tree(root: int, include_root: bool = True) -> None:
    """SIGKILL ``root``'s process group and every process of its tree, until none is left."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while time.monotonic() < deadline:
        alive = [pid for pid in process_tree(root, include_root) if alive_not_zombie(pid)]
        if not alive:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root, signal.SIGKILL)
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    logger.error(f"sandbox process tree of {root} still has processes {KILL_TIMEOUT_S} s after SIGKILL")


def alive_not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
