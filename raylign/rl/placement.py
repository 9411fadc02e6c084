"""Where the model workers of an RL run go: Ray placement groups, and the GPUs a run needs.

Separate placement gives every role its own placement group (its ranks packed onto as few
nodes as possible). Colocated placement (the hybrid engine) gives one group whose bundle r
holds rank r of every role; on GPUs that bundle is GPU r, shared in equal fractions, and the
policy rank's rollout engine lives in the policy worker's process on the same GPU.
"""

from __future__ import annotations

from typing import Any

from raylign.config.rl import RLConfig


def gpus_needed(cfg: RLConfig) -> int:
    """GPUs a run reserves on a GPU cluster: one per model-worker rank (colocated: one per policy rank,
    shared by every role and the policy's engine) plus ``tensor_parallel_size`` per separate engine."""
    p, r = cfg.placement, cfg.rollout
    if p.colocate:
        return p.policy_workers
    return sum(cfg.worker_roles.values()) + r.num_engines * r.tensor_parallel_size


def check_gpu_count(cfg: RLConfig, cluster_gpus: float) -> None:
    """Fail before any actor starts, rather than wait forever for GPUs the cluster does not have."""
    needed = gpus_needed(cfg)
    if needed > cluster_gpus:
        p, r = cfg.placement, cfg.rollout
        parts = ", ".join(f"placement.{role}_workers={n}" for role, n in cfg.worker_roles.items())
        how = (
            f"placement.colocate: one per policy rank ({parts})"
            if p.colocate
            else f"one per worker rank ({parts}) plus rollout.num_engines={r.num_engines} x "
            f"rollout.tensor_parallel_size={r.tensor_parallel_size}"
        )
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
