"""benchmarks/child_runs.py: a stopped benchmark stops the side it runs, which would otherwise keep
computing (and keep its Ray session) after the driver is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A benchmark whose one side writes its pid and then works far longer than the test waits.
SCRIPT = """
import argparse, os, sys, time
from pathlib import Path
sys.path.insert(0, {benchmarks!r})
from child_runs import launch, run_benchmark

def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--side")
    p.add_argument("--spec", type=Path)
    p.add_argument("--workdir", type=Path)
    return p.parse_args()

def run_side(side, spec):
    (spec.parent / "child.pid").write_text(str(os.getpid()))
    time.sleep(300)

def body(args, workdir, load):
    return [{{"errors": [launch(__file__, "slow", {{}}, workdir / "slow")]}}]

run_benchmark(parse_args, run_side, "child-runs-test-", body)
"""


def wait_for(path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was not written within {timeout_s} s"
        time.sleep(0.05)
    return path.read_text()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_driver_ends_its_child(tmp_path: Path) -> None:
    script = tmp_path / "slow_benchmark.py"
    script.write_text(SCRIPT.format(benchmarks=str(REPO / "benchmarks")))
    workdir = tmp_path / "work"
    driver = subprocess.Popen([sys.executable, str(script), "--workdir", str(workdir)])
    try:
        child = int(wait_for(workdir / "slow" / "child.pid", 60))
        assert alive(child)
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(30) == 128 + signal.SIGTERM
        assert not alive(child), "the side's child process outlived its stopped driver"
    finally:
        driver.kill()
        driver.wait(10)
