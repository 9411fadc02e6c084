"""Code run inside the 4 spawned gloo ranks of ``test_sft_tensor_parallel.py``: the same SFT run with
``engine.tensor_parallel_size`` 1 (4 data-parallel ranks), 2 (a 2 x 2 mesh: 2 data-parallel ranks,
each splitting every matrix over 2) and 4 (one data-parallel rank split over all 4), one after the
other in one process group."""

from __future__ import annotations

import os
from pathlib import Path

import torch

WORLD_SIZE = 4
STEPS = 3
SIZES = (1, 2, 4)


def sft_config(model_dir: str, train_file: str, out: Path, tensor_parallel_size: int):
    from raylign.config.base import parse_config
    from raylign.config.commands import SFTConfig

    return parse_config(
        SFTConfig,
        {
            "model": {"path": model_dir, "dtype": "float32"},
            "data": {"train": [train_file], "format": "chat", "max_length": 64, "min_response_tokens": 8},
            "engine": {"backend": "fsdp2", "tensor_parallel_size": tensor_parallel_size, "dist_timeout_s": 120},
            # A large AdamW epsilon keeps each update proportional to its gradient, so weights whose gradients
            # are equal to rounding stay comparable (see sft_sequence_parallel_worker.py).
            "optim": {"lr": 3e-3, "warmup_steps": 1, "weight_decay": 0.0, "eps": 1e-3, "max_grad_norm": 0.5},
            "train": {
                "output_dir": str(out),
                "max_steps": STEPS,
                "global_batch_size": 4,
                "micro_batch_size": 1,
                "seed": 0,
                "logging": {"progress_bar": False, "tensorboard": False},
            },
        },
    )


def run_rank(rank: int, port: int, model_dir: str, train_file: str, out_dir: str) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    from raylign.trainers.sft import SFTTrainer

    try:
        for size in SIZES:
            SFTTrainer(sft_config(model_dir, train_file, Path(out_dir) / f"tp{size}", size)).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
