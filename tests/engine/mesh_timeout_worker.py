"""Ranks for ``test_mesh_timeout.py``: four gloo ranks build the engine's meshes under a short
``engine.dist_timeout_s``, the tensor-parallel one and HSDP's; rank 0 waits in a collective of each
layout's group that its partner never joins, one after the other, and writes how long it waited and what
it was told."""

from __future__ import annotations

from pathlib import Path

from raylign.engine.distributed import ensure_process_group
from raylign.engine.fsdp2 import build_meshes
from tests.spawned_ranks import as_gloo_rank, time_unanswered_all_reduce

WORLD_SIZE = 4
TIMEOUT_S = 5
# The default group's own timeout: generous for the ranks' start-up, and another value than the mesh groups',
# so a mesh group that inherited it instead of being given TIMEOUT_S would wait 60 s.
DEFAULT_GROUP_TIMEOUT_S = 60
# name: (tensor_parallel_size, data_parallel_shard_size)
LAYOUTS = {"tensor_parallel": (2, None), "hsdp": (1, 2)}


def run_rank(rank: int, port: int, out_dir: str) -> None:
    as_gloo_rank(rank, WORLD_SIZE, port)
    ensure_process_group(DEFAULT_GROUP_TIMEOUT_S)
    groups = {}
    for name, (tensor_parallel, shard_size) in LAYOUTS.items():  # every rank makes every group
        mesh, data_mesh = build_meshes("cpu", WORLD_SIZE, tensor_parallel, shard_size, TIMEOUT_S)
        groups[name] = (mesh["tp"] if tensor_parallel > 1 else data_mesh["shard"]).get_group()
    if rank == 0:  # its partner (rank 1 in either layout) waits for it to finish, in no collective
        for name, group in groups.items():
            time_unanswered_all_reduce(group, str(Path(out_dir) / f"rank0_{name}.json"))
