"""Ray for a pipeline command: join a cluster, reuse a running Ray, or start (and stop) a local one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from raylign.config.pipeline import RayRuntimeConfig

# One thread per actor: several actors each using every core slow one another down many times over.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}
SPARE_CPUS = 2


@contextlib.contextmanager
def ray_runtime(cfg: RayRuntimeConfig, cpus_needed: float) -> Iterator[None]:
    """Make Ray available for the block; a Ray started here is shut down when the block ends.

    A Ray already initialised in this process (a notebook, a test session) is used as it is
    and left running.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    if cfg.address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local instance needs no token
        num_cpus = cfg.num_cpus or max(4, int(cpus_needed + 0.999) + SPARE_CPUS)
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": WORKER_ENV})
    else:
        ray.init(address=cfg.address, include_dashboard=False, runtime_env={"env_vars": WORKER_ENV})
    try:
        yield
    finally:
        ray.shutdown()
