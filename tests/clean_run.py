"""Commands run as a newcomer runs them: in a fresh clone, from a clean environment.

Nothing is inherited from the test suite: each command runs under ``env -i HOME=$HOME
PATH=...``. The clone uses the environment ``scripts/install.sh`` made (``.ci/run`` runs that
install on a fresh clone itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
CLEAN_ENV = {"HOME": os.environ.get("HOME", "/root"), "PATH": SYSTEM_PATH}


def fresh_clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300, env=CLEAN_ENV)
    (clone / ".venv").symlink_to(Path(sys.prefix))  # the environment scripts/install.sh made
    return clone


def run_clean(command: str, cwd: Path, timeout: float, path: str = SYSTEM_PATH) -> subprocess.CompletedProcess:
    """``bash -c command`` under ``env -i`` with HOME and ``path`` only; asserts it exits 0."""
    env = {**CLEAN_ENV, "PATH": path}
    proc = subprocess.run(
        ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "bash", "-c", command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc
