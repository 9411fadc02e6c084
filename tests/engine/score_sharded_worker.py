"""Code run inside the 2 spawned gloo ranks of ``test_engine_load_sharded_score.py``: a score model loaded
whole and shard by shard with fsdp2, from a saved score model and from a plain causal LM; rank 0 saves
the gathered weights and one step's loss and gradient norm of each."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.spawned_ranks import as_gloo_rank

WORLD_SIZE = 2


def run_rank(rank: int, port: int, folders: dict[str, str], out_dir: str) -> None:
    from raylign.config.engine import EngineConfig
    from raylign.config.model import ModelConfig
    from raylign.config.optim import OptimConfig
    from raylign.engine import create_engine
    from raylign.models import load_score_model

    results = {}
    as_gloo_rank(rank, WORLD_SIZE, port)
    for kind, folder in folders.items():
        for sharded in (False, True):
            torch.manual_seed(0)
            cfg = ModelConfig(path=folder, dtype="float32")
            model = load_score_model(cfg, num_labels=1, empty=sharded)
            engine_cfg = EngineConfig(backend="fsdp2", load_sharded=sharded, dist_timeout_s=120)
            engine = create_engine(model, engine_cfg, OptimConfig(lr=1e-3), total_steps=1)
            weights = engine.full_state_dict()
            ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
            loss = engine.module(input_ids=ids).logits.float().pow(2).mean()
            engine.backward(loss)
            step = engine.step()
            results[(kind, sharded)] = {"weights": weights, "loss": float(loss), "grad_norm": step["grad_norm"]}
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")
