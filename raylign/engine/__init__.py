"""Training engines: one interface (:class:`TrainEngine`), three backends.

    engine = create_engine(model, engine_cfg, optim_cfg, total_steps)
    for batch in micro_batches:
        engine.backward(loss_fn(engine.module(**batch)) / len(micro_batches))
    metrics = engine.step()

``local`` runs the plain model in one process; ``fsdp2`` shards it with torch ``fully_shard``;
``deepspeed`` uses ZeRO 1/2/3. The sharded backends join (or create) the process group
described by torchrun / Ray environment variables.
"""

from __future__ import annotations

import torch

from raylign.config.engine import EngineConfig
from raylign.config.model import ModelConfig
from raylign.config.optim import OptimConfig
from raylign.engine.base import TrainEngine
from raylign.engine.checkpoint import latest_checkpoint, resume_latest, save_step_checkpoint
from raylign.engine.distributed import init_distributed, is_main_process

__all__ = [
    "TrainEngine",
    "create_engine",
    "load_frozen",
    "init_distributed",
    "is_main_process",
    "latest_checkpoint",
    "resume_latest",
    "save_step_checkpoint",
]


def create_engine(
    model: torch.nn.Module, engine_cfg: EngineConfig, optim_cfg: OptimConfig, total_steps: int
) -> TrainEngine:
    """Wrap ``model`` (built by the caller on every rank with the same seed) in the configured backend.

    ``total_steps`` is the number of optimizer steps the schedule spans.
    """
    if engine_cfg.backend == "local":
        from raylign.engine.distributed import get_world_size
        from raylign.engine.local import LocalEngine

        if get_world_size() > 1:
            raise ValueError(
                f"engine.backend 'local' runs in one process, but {get_world_size()} ranks are running: "
                "use 'fsdp2' or 'deepspeed' for several processes"
            )
        return LocalEngine(model, engine_cfg, optim_cfg, total_steps)
    if engine_cfg.backend == "fsdp2":
        from raylign.engine.fsdp2 import FSDP2Engine

        return FSDP2Engine(model, engine_cfg, optim_cfg, total_steps)
    if engine_cfg.backend == "deepspeed":
        from raylign.config.engine import refuse_master_weights_off
        from raylign.engine.deepspeed import DeepSpeedZeroEngine

        refuse_master_weights_off(engine_cfg, optim_cfg)  # the commands' configs refuse it before anything starts

        return DeepSpeedZeroEngine(model, engine_cfg, optim_cfg, total_steps)
    raise ValueError(f"engine.backend must be one of local, fsdp2, deepspeed (got {engine_cfg.backend!r})")


def load_frozen(model_cfg: ModelConfig, engine_cfg: EngineConfig, device: torch.device) -> torch.nn.Module:
    """A frozen model every rank computes with (a reference, a teacher), in eval mode and without gradients.

    With the fsdp2 backend on several ranks it is sharded like the trained model
    (:func:`raylign.engine.fsdp2.shard_frozen`: each rank keeps its shard in the model's dtype, read
    shard by shard when ``engine.load_sharded``): its forward is then a collective, so every rank
    must call it as often as the others, as the trained model's own forward requires. Otherwise
    each rank holds a whole copy on ``device``."""
    from raylign.engine.distributed import get_world_size
    from raylign.models import load_causal_lm, loads_sharded

    if engine_cfg.backend == "fsdp2" and get_world_size() > 1:
        from raylign.engine.fsdp2 import shard_frozen

        return shard_frozen(load_causal_lm(model_cfg, empty=loads_sharded(model_cfg, engine_cfg)), engine_cfg)[0]
    return load_causal_lm(model_cfg, device=device).eval().requires_grad_(False)
