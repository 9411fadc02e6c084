"""A data-parallel group of :class:`ModelWorker` Ray actors, placed together and driven as one.

The group's rendezvous is hosted by rank 0, on the node Ray put it on: rank 0 opens the store
there and reports its address and port, and only then do the ranks join the process group and
load their models. The controller's own node plays no part (it may not even be one of the
workers' nodes).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylign.cluster import actor_env, get_within, wait_until_ready
from raylign.rl.worker import ModelWorker

log = logging.getLogger("raylign")


class PhaseResults(NamedTuple):
    """What each rank of a phase call answered (``ModelWorker.in_phase``), in rank order."""

    results: list[Any]
    threads: list[int]  # the torch threads it computed with
    peaks: list[int | None]  # its peak memory in bytes (None where it could not be measured)
    seconds: list[float]  # how long the method ran in the rank's process


class WorkerGroup:
    def __init__(
        self,
        role: str,
        cfg: dict[str, Any],
        num_workers: int,
        total_steps: int,
        placement_group: PlacementGroup | None,
        bundle_offset: int = 0,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        call_timeout_s: float = 3600.0,
    ):
        """``call_timeout_s``: the longest wait for the ranks' answers to one :meth:`call`
        (``placement.worker_call_timeout_s``)."""
        self.role = role
        self.call_timeout_s = call_timeout_s
        actor_cls = ray.remote(ModelWorker)
        self.workers = []
        for rank in range(num_workers):
            options: dict[str, Any] = {
                "num_cpus": num_cpus,
                "num_gpus": num_gpus,
                "runtime_env": {"env_vars": actor_env(env)},
            }
            if placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle_offset + rank
                )
            self.workers.append(actor_cls.options(**options).remote(role, cfg, rank, num_workers, total_steps))
        names = [f"{role} worker rank {rank}" for rank in range(num_workers)]
        try:
            # ``(address, port)`` of the store rank 0 hosts on its own node (None for the reference).
            (self.rendezvous,) = wait_until_ready(
                {names[0]: self.workers[0]},
                startup_timeout_s,
                ready={names[0]: self.workers[0].rendezvous_address.remote()},
            )
            # Fail here, naming the rank, if a worker could not start (process group formed, model loaded).
            wait_until_ready(
                dict(zip(names, self.workers)),
                startup_timeout_s,
                ready={name: worker.start.remote(self.rendezvous) for name, worker in zip(names, self.workers)},
            )
        except BaseException:
            self.kill()  # the ranks that did start would otherwise hold their resources
            raise

    def __len__(self) -> int:
        return len(self.workers)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every rank, results in rank order."""
        return self._results(method, [getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def call_sharded(self, method: str, per_rank: list[Any]) -> list[Any]:
        """Rank r gets ``per_rank[r]``; results in rank order."""
        return self._results(method, [getattr(w, method).remote(arg) for w, arg in zip(self.workers, per_rank)])

    def call_in_phase(self, method: str, per_rank: list[Any], threads: list[int]) -> PhaseResults:
        """:meth:`call_sharded`, rank r computing on ``threads[r]`` torch threads; the results, the
        threads, the peak memory and the seconds of compute each rank reported (``ModelWorker.in_phase``),
        in rank order."""
        return self.phase_results(method, self.submit_in_phase(method, per_rank, threads))

    def submit_in_phase(self, method: str, per_rank: list[Any], threads: list[int]) -> list[Any]:
        """:meth:`call_in_phase` without waiting: the calls in flight, for :meth:`phase_results`."""
        return [w.in_phase.remote(n, method, arg) for w, n, arg in zip(self.workers, threads, per_rank)]

    def phase_results(self, method: str, refs: list[Any]) -> PhaseResults:
        answers = self._results(method, refs)
        return PhaseResults(*([a[i] for a in answers] for i in range(4)))

    def _results(self, method: str, refs: list[Any]) -> list[Any]:
        """The ranks' answers, waiting at most ``placement.worker_call_timeout_s``."""
        names = [f"rank {rank} of {len(refs)}" for rank in range(len(refs))]
        return get_within(
            refs, self.call_timeout_s, f"{self.role} workers' {method}", "placement.worker_call_timeout_s", names
        )

    def kill(self) -> None:
        for worker in self.workers:
            ray.kill(worker)

    def stop_local_engines(self, timeout_s: float = 60.0) -> None:
        """Let each rank stop its colocated engine, waiting at most ``timeout_s`` (then the workers can be
        killed without leaving the engines' shared memory behind)."""
        refs = [worker.stop_local_engine.remote() for worker in self.workers]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        failed = []
        for rank, ref in enumerate(refs):
            if ref in pending:
                failed.append(f"rank {rank}: not within {timeout_s:g} s")
                continue
            try:
                ray.get(ref, timeout=timeout_s)  # done already (ray.wait above)
            except Exception as err:  # a rank that died already: nothing of it is left to stop
                failed.append(f"rank {rank}: {type(err).__name__}")
        if failed:
            log.warning("%s workers' colocated engines did not all stop cleanly (%s)", self.role, "; ".join(failed))
