"""What the sandbox tests look for on the host: the processes a sandboxed run started."""

from __future__ import annotations

import os

from raylign.agents.sandbox import BOOTSTRAP_MARKER


def sandbox_processes() -> list[int]:
    """Pids of processes started by the sandbox (their command line holds the bootstrap)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if BOOTSTRAP_MARKER.encode() in cmdline.read():
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids
