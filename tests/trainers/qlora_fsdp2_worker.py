"""Code run inside the 2 spawned gloo ranks of ``test_qlora_fsdp2.py``: SFT of LoRA adapters on a 4-bit
base with fsdp2 over both ranks, to the end, and again stopped after step 2 and resumed from its
checkpoint; with each packed row split over both ranks (sequence parallel 2); and what each rank
holds of the model."""

from __future__ import annotations

import json
from pathlib import Path

from tests.spawned_ranks import as_gloo_rank

WORLD_SIZE = 2
STEPS = 3


def sft_config(model_dir: str, train_file: str, out: Path, backend: str, steps: int = STEPS, **engine):
    from raylign.config.base import parse_config
    from raylign.config.commands import SFTConfig

    return parse_config(
        SFTConfig,
        {
            "model": {"path": model_dir, "dtype": "float32", "lora": {"rank": 4, "alpha": 8, "quantize_base": "nf4"}},
            "data": {"train": [train_file], "format": "chat", "max_length": 64, "min_response_tokens": 8},
            "engine": {"backend": backend, "dist_timeout_s": 120, **engine},
            # A large AdamW epsilon keeps each update proportional to its gradient (sft_sequence_parallel_worker.py);
            # a constant rate after warm-up: a run resumed at step 3 sees the rates of one that did not stop.
            "optim": {
                "lr": 3e-3,
                "warmup_steps": 1,
                "scheduler": "constant",
                "weight_decay": 0.0,
                "eps": 1e-3,
                "max_grad_norm": 0.5,
            },
            "train": {
                "output_dir": str(out),
                "max_steps": steps,
                "save_every": 1,
                "global_batch_size": 4,
                "micro_batch_size": 1,
                "seed": 0,
                "logging": {"progress_bar": False, "tensorboard": False},
            },
        },
    )


def run_rank(rank: int, port: int, model_dir: str, train_file: str, out_dir: str) -> None:
    from raylign.trainers.sft import SFTTrainer

    out = Path(out_dir)
    with as_gloo_rank(rank, WORLD_SIZE, port):
        trainer = SFTTrainer(sft_config(model_dir, train_file, out / "fsdp2", "fsdp2"))
        trainer.run()
        record_holdings(trainer.engine.module, out / f"holdings_rank{rank}.json")
        SFTTrainer(sft_config(model_dir, train_file, out / "fsdp2_resumed", "fsdp2", steps=2)).run()
        SFTTrainer(sft_config(model_dir, train_file, out / "fsdp2_resumed", "fsdp2")).run()
        SFTTrainer(sft_config(model_dir, train_file, out / "fsdp2_sp2", "fsdp2", sequence_parallel_size=2)).run()


def record_holdings(module, path: Path) -> None:
    """For the first layer's q_proj: the packed 4-bit weight's element count on this rank (all of it, or a
    shard), and whether its adapter matrices are sharded DTensors."""
    from torch.distributed.tensor import DTensor

    layer = module.base_model.model.model.layers[0].self_attn.q_proj
    adapter = layer.lora_A["default"].weight
    holdings = {
        "packed_elements": layer.base_layer.weight.numel(),
        "packed_dtype": str(layer.base_layer.weight.dtype),
        "adapter_sharded": isinstance(adapter, DTensor),
        "adapter_local_rows": adapter.to_local().shape[0] if isinstance(adapter, DTensor) else adapter.shape[0],
    }
    path.write_text(json.dumps(holdings))
