"""Actors started by raylign write into memory they used before: a training step's large tensors
(logits, the output layer's gradient) are freed and made again every step, and with glibc's
defaults each of them is fresh pages from the kernel, every first write a page fault. Measured with
real Ray actors that allocate, write and free tensors of 8-64 MiB round after round, counting the
page faults of the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROUNDS = 12
SIZES_MIB = (8, 24, 40, 64)
PAGE = 4096


def fault_fraction_per_round() -> list[float]:
    """For each round, the page faults it took over the pages it wrote (1.0: every page fresh)."""
    import resource

    import torch

    torch.set_num_threads(1)
    pages = sum(size << 20 for size in SIZES_MIB) // PAGE
    fractions = []
    for _ in range(ROUNDS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tensors = [torch.empty(size << 20, dtype=torch.uint8) for size in SIZES_MIB]
        for tensor in tensors:
            tensor.fill_(1)
        del tensors
        fractions.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / pages)
    return fractions


class Allocator:
    def fault_fraction_per_round(self) -> list[float]:
        return fault_fraction_per_round()


@pytest.mark.slow
def test_actors_reuse_freed_memory_where_glibcs_defaults_fault_it_in_again(ray_session):
    ray = ray_session
    from raylign.cluster import get_within

    remote = ray.remote(Allocator)
    reusing = remote.options(num_cpus=0).remote()  # the environment every raylign actor gets
    defaults = remote.options(num_cpus=0, runtime_env={"env_vars": {"GLIBC_TUNABLES": ""}}).remote()
    try:
        with_reuse, with_defaults = get_within(
            [reusing.fault_fraction_per_round.remote(), defaults.fault_fraction_per_round.remote()],
            120,
            "allocation rounds",
            "(test)",
        )
    finally:
        for actor in (reusing, defaults):
            ray.kill(actor)
    # The first rounds grow the heap either way; from then on only glibc's defaults fault again.
    assert max(with_reuse[-4:]) < 0.1, with_reuse
    assert min(with_defaults[-4:]) > 0.4, with_defaults


# A raylign command's own process (it trains when it runs on one rank): the CLI's entry sets the
# same through mallopt, the environment being read only at a process's start.
AS_A_COMMAND = """
import json
from raylign.cli.main import main
main(["--help"])
from tests.test_actor_memory import fault_fraction_per_round
print(json.dumps(fault_fraction_per_round()))
"""


@pytest.mark.parametrize("tunables", [None, ""], ids=["raylign", "glibc-defaults"])
def test_a_raylign_command_reuses_freed_memory_unless_told_otherwise(tunables):
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    out = subprocess.run(
        [sys.executable, "-c", AS_A_COMMAND],
        cwd=Path(__file__).parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])[-4:]
    if tunables is None:
        assert max(last) < 0.1, last
    else:
        assert min(last) > 0.4, last
