"""Ray for a pipeline command: join a cluster, reuse a running Ray, or start (and stop) a local one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from raylign.cluster import ray_session
from raylign.config.pipeline import RayRuntimeConfig

SPARE_CPUS = 2


@contextlib.contextmanager
def ray_runtime(cfg: RayRuntimeConfig, cpus_needed: float) -> Iterator[None]:
    """Make Ray available for the block; a Ray started here is shut down when the block ends.

    A Ray already initialised in this process (a notebook, a test session) is used as it is
    and left running.
    """
    num_cpus = None if cfg.address else (cfg.num_cpus or max(4, int(cpus_needed + 0.999) + SPARE_CPUS))
    with ray_session(cfg.address, num_cpus):
        yield
