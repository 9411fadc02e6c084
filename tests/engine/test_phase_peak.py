"""``PhasePeak``: the peak memory of a phase, which the RL workers report as ``peak_memory_gb/<phase>``.

On the CPU it is the process's resident high-water mark, reset when the phase starts: a phase that
touches 64 MiB and frees it before it ends must report at least that much above where it started,
and the next phase, which allocates nothing, must not report it again.

The phases run in a fresh interpreter. A process that has run other tests may hold freed pages that
its allocator hands out again, so a new block there need not raise the resident size at all; in a
fresh process, with allocations above 64 KiB mapped from the kernel, every page of the block is new.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]

PHASES = """
import json, torch
from raylign.engine.memory import PhasePeak

def resident():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

before = resident()
with PhasePeak(torch.device("cpu")) as busy:
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB of float32, every page written
    del block
with PhasePeak(torch.device("cpu")) as idle:
    pass
print(json.dumps({"before": before, "busy": busy.bytes, "idle": idle.bytes}))
"""


def test_a_phase_reports_what_it_touched_and_the_next_does_not():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run([sys.executable, "-c", PHASES], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["busy"] is not None and figures["idle"] is not None
    assert figures["busy"] >= figures["before"] + 64 * MIB - 4 * MIB  # a few pages may have been resident already
    assert figures["idle"] < figures["busy"] - 32 * MIB  # the mark was reset: the freed block is not counted again
