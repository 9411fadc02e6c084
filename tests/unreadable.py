"""Run a command in a process that may not read a given file.

The file's mode becomes 000. Root reads such a file all the same (the capabilities
CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH), so under root the command runs with those two taken
out of its bounding set: still root, owner of the file, and refused by its mode like anyone else.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

PR_CAPBSET_DROP = 24  # <linux/prctl.h>
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2  # <linux/capability.h>


def _drop_read_any_file() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(errno)}")


def run_unable_to_read(path: Path, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Make ``path`` unreadable (mode 000) and run ``python argv...`` in a process that cannot read it."""
    mode = path.stat().st_mode
    path.chmod(0)
    try:
        return subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=cwd,
            preexec_fn=_drop_read_any_file if os.geteuid() == 0 else None,
        )
    except subprocess.SubprocessError as err:  # the preexec function failed: no CAP_SETPCAP here
        pytest.skip(f"cannot start a process that root's file permissions apply to: {err}")
    finally:
        path.chmod(mode)
