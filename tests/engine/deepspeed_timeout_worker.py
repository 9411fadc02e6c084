"""Ranks for ``test_mesh_timeout.py``'s DeepSpeed case: two gloo ranks build a DeepSpeed AutoTP (2)
engine under a short ``engine.dist_timeout_s``; rank 0 waits in a collective of DeepSpeed's
tensor-parallel group that its partner never joins, and writes how long it waited and what it was told."""

from __future__ import annotations

import torch.distributed as dist

from tests.spawned_ranks import as_gloo_rank, time_unanswered_all_reduce

WORLD_SIZE = 2
TIMEOUT_S = 10


def run_rank(rank: int, port: int, out: str, model_dir: str) -> None:
    from deepspeed.utils import groups

    from raylign.config.engine import EngineConfig
    from raylign.config.model import ModelConfig
    from raylign.config.optim import OptimConfig
    from raylign.engine import create_engine
    from raylign.models import load_causal_lm

    as_gloo_rank(rank, WORLD_SIZE, port)
    model = load_causal_lm(ModelConfig(path=model_dir, dtype="float32"))
    engine_cfg = EngineConfig(backend="deepspeed", zero_stage=1, tensor_parallel_size=2, dist_timeout_s=TIMEOUT_S)
    create_engine(model, engine_cfg, OptimConfig(), total_steps=1)
    group = groups.get_tensor_model_parallel_group()
    assert dist.get_world_size(group) == 2, "the tensor-parallel group should hold both ranks"
    if rank == 0:  # its partner returns at once
        time_unanswered_all_reduce(group, out)
