"""Where the model workers of an RL run go: Ray placement groups, the GPUs a run needs, and the
torch threads each worker computes with.

Separate placement gives every role its own placement group (its ranks packed onto as few
nodes as possible). Colocated placement (the hybrid engine) gives one group whose bundle r
holds rank r of every role; on GPUs that bundle is GPU r, shared in equal fractions, and the
policy rank's rollout engine lives in the policy worker's process on the same GPU.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any

from raylign.config.rl import RLConfig
from raylign.config.rollout import RolloutConfig


def reward_model_gpus(cfg: RLConfig) -> dict[str, float]:
    """The GPUs each reward-model actor asks for, by its field (``reward.sources[1].num_gpus``);
    sources that ask for none are left out."""
    sources = cfg.reward.sources if cfg.reward is not None else []
    return {
        f"reward.sources[{i}].num_gpus": s.num_gpus
        for i, s in enumerate(sources)
        if s.kind == "reward_model" and s.num_gpus > 0
    }


def gpus_needed(cfg: RLConfig, cluster_has_gpus: bool = True) -> int:
    """GPUs a run reserves: one per model-worker rank (colocated: one per policy rank, shared by
    every role and the policy's engine) plus ``tensor_parallel_size`` per separate engine, plus
    the reward-model actors' ``num_gpus``, summed and rounded up (actors asking for fractions of a
    GPU can share one; this is the least they need). On a cluster without GPUs the workers and
    engines run on CPUs and only the reward models ask for GPUs."""
    p, r = cfg.placement, cfg.rollout
    reward = math.ceil(sum(reward_model_gpus(cfg).values()))
    if not cluster_has_gpus:
        return reward
    if p.colocate:
        return p.policy_workers + reward
    return sum(cfg.worker_roles.values()) + r.num_engines * r.tensor_parallel_size + reward


def check_gpu_count(cfg: RLConfig, cluster_gpus: float) -> None:
    """Fail before any actor starts, rather than wait forever for GPUs the cluster does not have."""
    has_gpus = cluster_gpus > 0
    needed = gpus_needed(cfg, has_gpus)
    if needed <= cluster_gpus:
        return
    p, r = cfg.placement, cfg.rollout
    reward = ", ".join(f"{field}={n:g}" for field, n in reward_model_gpus(cfg).items())
    if not has_gpus:
        raise ValueError(
            f"the reward models ask for {needed} GPUs ({reward}), the Ray cluster has none; set those fields "
            "to 0 to run them on CPUs, or join a cluster with GPUs (placement.ray_address)"
        )
    parts = ", ".join(f"placement.{role}_workers={n}" for role, n in cfg.worker_roles.items())
    how = (
        f"placement.colocate: one per policy rank ({parts})"
        if p.colocate
        else f"one per worker rank ({parts}) plus rollout.num_engines={r.num_engines} x "
        f"rollout.tensor_parallel_size={r.tensor_parallel_size}"
    )
    if reward:
        how += f", plus the reward-model actors ({reward})"
    raise ValueError(
        f"the run needs {needed} GPUs ({how}), the Ray cluster has {cluster_gpus:g}; "
        "lower those numbers or set placement.colocate: true"
    )


def placement_groups(cfg: RLConfig, has_gpus: bool) -> list[Any]:
    """Ray placement groups of the model workers, ready.

    Separate placement: one group per role, one bundle per rank, packed onto as few nodes as
    possible (data-parallel peers talk every step). Colocated: one group whose bundle r holds
    rank r of every role (and, on GPUs, GPU r).
    """
    import ray
    from ray.util.placement_group import placement_group

    p, roles = cfg.placement, cfg.worker_roles
    gpu = {"GPU": 1.0} if has_gpus else {}
    if p.colocate:
        specs = [[{"CPU": p.cpus_per_worker * len(roles), **gpu} for _ in range(p.policy_workers)]]
    else:
        specs = [[{"CPU": p.cpus_per_worker, **gpu} for _ in range(workers)] for workers in roles.values()]
    groups = [placement_group(bundles, strategy="PACK") for bundles in specs]
    ready, pending = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=p.startup_timeout_s)
    if pending:
        for group in groups:
            ray.util.remove_placement_group(group)
        from raylign.cluster import StartupError

        raise StartupError(
            f"{len(pending)} of {len(groups)} placement groups (bundles {specs}) were not granted within "
            f"{p.startup_timeout_s:g} s (placement.startup_timeout_s); the cluster has "
            f"{ray.available_resources()} free: lower placement.cpus_per_worker or the worker counts, or add nodes"
        )
    return groups


def worker_nodes(groups: list[Any]) -> set[str]:
    """Ids of the nodes the placement groups' bundles were granted on."""
    from ray.util.placement_group import placement_group_table

    return {node for group in groups for node in placement_group_table(group)["bundles_to_node_id"].values()}


def threads_per_worker(cores: float, busy_cores: float, workers: int) -> int:
    """Torch compute threads for each of ``workers`` processes that compute at the same time on a
    node of ``cores`` cores, while other work keeps ``busy_cores`` of them busy: an equal share of
    the free cores, ``floor((cores - busy_cores) / workers)``, at least 1."""
    return max(1, math.floor((cores - busy_cores) / workers))


def engine_threads(r: RolloutConfig, node_cores: float, has_gpus: bool, busy_cores: float = 0.0) -> int:
    """Compute threads of each rollout engine actor (``rollout.threads_per_engine``): pinned, or with
    ``auto`` on CPU in a synchronous run (``rollout.max_staleness`` 0, training waits while the engines
    generate) an equal share among ``rollout.num_engines`` of the ``node_cores`` that the reference
    passes beside them (``busy_cores``) leave, at least 1; in streaming runs, where the training
    workers compute beside them (:func:`phase_threads` leaves them these cores), and on GPUs,
    ``rollout.num_cpus_per_engine``, at least 1."""
    if r.threads_per_engine != "auto":
        return r.threads_per_engine
    if has_gpus or r.max_staleness > 0:
        return max(1, int(r.num_cpus_per_engine))
    return threads_per_worker(node_cores, busy_cores, r.num_engines)


def probes_at_once(has_gpus: bool, engine_threads: int, num_engines: int, policy_threads: int, cores: float) -> bool:
    """Whether the policy and the engines score a sync's probe at the same time: on GPUs, or where
    their threads fit the node's cores together. Two scorers computing on the same cores at once slowed
    each other 4-7x (OpenMP threads waiting for ones the other process displaced): on 2 cores the
    probe took 0.7-1.9 s at once, 0.33-0.46 s one after the other (``benchmarks/README.md``)."""
    return has_gpus or engine_threads * num_engines + policy_threads <= cores


def engine_node_cores(ray_address: str | None) -> float:
    """Cores of a node the engines run on: this machine's (those this process may use) with a local
    Ray; on a cluster the smallest CPU count a live node offers Ray (which node an engine lands on is
    Ray's choice)."""
    if ray_address is None:
        return float(len(os.sched_getaffinity(0)))
    import ray

    offered = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]]
    return min((c for c in offered if c > 0), default=1.0)


def phase_threads(
    cfg: RLConfig, rank_nodes: list[str], node_cores: dict[str, float], engine_nodes: list[str], has_gpus: bool
) -> list[int]:
    """Torch threads of each rank of one worker group (rank r on node ``rank_nodes[r]``) during its
    phases: its forward passes and updates, which no other group computes beside.

    ``placement.threads_per_worker`` when pinned; on GPUs one per reserved CPU slot
    (``placement.cpus_per_worker``, at least 1); otherwise each rank's share of its node's cores
    (``node_cores``) with the group's other ranks on that node, less the cores the rollout engines on
    that node (``engine_nodes``) keep busy when they generate beside training (``rollout.max_staleness``
    >= 1): ``rollout.num_cpus_per_engine`` each.
    """
    p, r = cfg.placement, cfg.rollout
    if p.threads_per_worker != "auto":
        return [p.threads_per_worker] * len(rank_nodes)
    if has_gpus:
        return [max(1, int(p.cpus_per_worker))] * len(rank_nodes)
    generating = Counter(engine_nodes) if r.max_staleness > 0 and not p.colocate else Counter()
    peers = Counter(rank_nodes)
    return [
        threads_per_worker(node_cores[node], generating[node] * r.num_cpus_per_engine, peers[node])
        for node in rank_nodes
    ]
