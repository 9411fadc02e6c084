"""``PhasePeak``: the peak memory of a phase, which the RL workers report as ``peak_memory_gb/<phase>``.

On the CPU it is the process's resident high-water mark, reset when the phase starts: a phase that
touches 64 MiB and frees it before it ends must report at least that much above where it started,
and the next phase, which allocates nothing, must not report it again.
"""

from __future__ import annotations

import sys

import pytest
import torch

from raylign.engine.memory import PhasePeak

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
MIB = 1 << 20


def resident() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_a_phase_reports_what_it_touched_and_the_next_does_not():
    before = resident()
    with PhasePeak(torch.device("cpu")) as busy:
        block = torch.ones(64 * MIB // 4)  # 64 MiB of float32, every page written
        del block
    with PhasePeak(torch.device("cpu")) as idle:
        pass
    assert busy.bytes is not None and idle.bytes is not None
    assert busy.bytes >= before + 64 * MIB - 4 * MIB  # a few pages may have been resident already
    assert idle.bytes < busy.bytes - 32 * MIB  # the mark was reset: the freed block is not counted again
