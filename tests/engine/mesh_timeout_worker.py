"""Ranks for ``test_mesh_timeout.py``: four gloo ranks build the engine's tensor-parallel mesh under a
short ``engine.dist_timeout_s``; rank 0 waits in a collective of its tensor-parallel group that its
partner never joins, and writes how long it waited and what it was told."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from raylign.engine.distributed import ensure_process_group
from raylign.engine.fsdp2 import build_meshes
from tests.spawned_ranks import as_gloo_rank

WORLD_SIZE = 4
TIMEOUT_S = 10


def run_rank(rank: int, port: int, out: str, tensor_parallel: int, shard_size: int | None) -> None:
    as_gloo_rank(rank, WORLD_SIZE, port)
    ensure_process_group(TIMEOUT_S)
    mesh, data_mesh = build_meshes("cpu", WORLD_SIZE, tensor_parallel, shard_size, TIMEOUT_S)
    group = (mesh["tp"] if tensor_parallel > 1 else data_mesh["shard"]).get_group()
    if rank == 0:  # its partner (rank 1 in either layout) returns at once
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            error = ""
        except RuntimeError as err:
            error = str(err)
        Path(out).write_text(json.dumps({"waited_s": time.monotonic() - started, "error": error}))
