"""Ranks for ``test_mesh_timeout.py``: four gloo ranks build the engine's tensor-parallel mesh under a
short ``engine.dist_timeout_s``; rank 0 waits in a collective of its tensor-parallel group that its
partner never joins, and writes how long it waited and what it was told."""

from __future__ import annotations

from raylign.engine.distributed import ensure_process_group
from raylign.engine.fsdp2 import build_meshes
from tests.spawned_ranks import as_gloo_rank, time_unanswered_all_reduce

WORLD_SIZE = 4
TIMEOUT_S = 5
# The default group's own timeout: generous for the ranks' start-up, and another value than the mesh groups',
# so a mesh group that inherited it instead of being given TIMEOUT_S would wait 60 s.
DEFAULT_GROUP_TIMEOUT_S = 60


def run_rank(rank: int, port: int, out: str, tensor_parallel: int, shard_size: int | None) -> None:
    as_gloo_rank(rank, WORLD_SIZE, port)
    ensure_process_group(DEFAULT_GROUP_TIMEOUT_S)
    mesh, data_mesh = build_meshes("cpu", WORLD_SIZE, tensor_parallel, shard_size, TIMEOUT_S)
    group = (mesh["tp"] if tensor_parallel > 1 else data_mesh["shard"]).get_group()
    if rank == 0:  # its partner (rank 1 in either layout) returns at once
        time_unanswered_all_reduce(group, out)
