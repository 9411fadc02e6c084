"""Code run inside the 4 spawned gloo ranks of ``test_sft_tensor_parallel.py``: the same SFT run with
``engine.tensor_parallel_size`` 1 (4 data-parallel ranks), 2 (a 2 x 2 mesh: 2 data-parallel ranks,
each splitting every matrix over 2) and 4 (one data-parallel rank split over all 4); then hybrid
sharding (``engine.data_parallel_shard_size`` 2: two groups of 2 ranks, each sharding the model,
replicating each other), tensor parallel 2 with the activations whole on every rank (not split
along the sequence), tensor parallel 2 with the 2 data-parallel ranks replicating (shard size 1),
tensor parallel 2 with gradient checkpointing, tensor parallel 2 stopped after step 2 and resumed
from its checkpoint, DeepSpeed AutoTP 2 with ZeRO-1, tensor parallel 2 with sequence parallel 2 (one
data-parallel rank: each row cut into 2 chunks, each chunk's matrices split over 2 ranks; ring and
Ulysses attention), and a LoRA
model on 4 data-parallel ranks and on the 2 x 2 mesh: one after the other in one process group."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.spawned_ranks import as_gloo_rank

WORLD_SIZE = 4
STEPS = 3
AUTOTP2 = {"backend": "deepspeed", "zero_stage": 1, "tensor_parallel_size": 2}  # DeepSpeed AutoTP beside ZeRO-1
# name -> engine fields, and "model" fields / "stop_after" (steps of a first run the second resumes from)
RUNS: dict[str, dict] = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp4": {"tensor_parallel_size": 4},
    "hsdp": {"data_parallel_shard_size": 2},
    # Two settings a run each, independent of each other: replication is its own mesh dimension, activation
    # sharding happens within the tensor-parallel pair; a resumed run recomputes with checkpointing as it trains.
    "tp2_replicated_whole_activations": {
        "tensor_parallel_size": 2,
        "data_parallel_shard_size": 1,
        "tensor_parallel_shard_activations": False,
    },
    "tp2_checkpointing_resumed": {
        "tensor_parallel_size": 2,
        "model": {"gradient_checkpointing": True},
        "stop_after": 2,
    },
    "deepspeed_tp2": AUTOTP2,
    "deepspeed_tp2_sp2": {**AUTOTP2, "sequence_parallel_size": 2},
    "tp2_sp2": {"tensor_parallel_size": 2, "sequence_parallel_size": 2},
    "tp2_sp2_ulysses": {"tensor_parallel_size": 2, "sequence_parallel_size": 2, "sequence_parallel_mode": "ulysses"},
    "lora_tp1": {"model": {"lora": {"rank": 4}}},
    "lora_tp2": {"tensor_parallel_size": 2, "model": {"lora": {"rank": 4}}},
}
# Each run trains as this one (4 data-parallel ranks holding whole layers) does.
BASELINE = {name: "lora_tp1" if name.startswith("lora") else "tp1" for name in RUNS}


def sft_config(model_dir: str, train_file: str, out: Path, run: dict, steps: int = STEPS):
    from raylign.config.base import parse_config
    from raylign.config.commands import SFTConfig

    return parse_config(
        SFTConfig,
        {
            "model": {"path": model_dir, "dtype": "float32", **run.get("model", {})},
            "data": {"train": [train_file], "format": "chat", "max_length": 64},
            "engine": {
                "backend": "fsdp2",
                "dist_timeout_s": 120,
                **{k: v for k, v in run.items() if k not in ("model", "stop_after")},
            },
            # A large AdamW epsilon keeps each update proportional to its gradient, so weights whose gradients
            # are equal to rounding stay comparable (see sft_sequence_parallel_worker.py).
            # A constant rate after warm-up: a run stopped after step 2 then resumed to step 3 sees the same rates.
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
                "global_batch_size": 4,
                "micro_batch_size": 1,
                "seed": 0,
                "logging": {"progress_bar": False, "tensorboard": False},
            },
        },
    )


def run_rank(rank: int, port: int, model_dir: str, train_file: str, out_dir: str) -> None:

    from raylign.trainers.sft import SFTTrainer

    as_gloo_rank(rank, WORLD_SIZE, port)
    for name, run in RUNS.items():
        if "stop_after" in run:
            SFTTrainer(sft_config(model_dir, train_file, Path(out_dir) / name, run, run["stop_after"])).run()
        trainer = SFTTrainer(sft_config(model_dir, train_file, Path(out_dir) / name, run))
        if name.startswith("tp2_sp2"):
            with counting_padded_chunks(Path(out_dir) / f"padded_chunks_{name}_rank{rank}.json"):
                trainer.run()
        else:
            trainer.run()
        if name == "lora_tp2":
            record_lora_blocks(trainer.engine.module, Path(out_dir) / f"lora_blocks_rank{rank}.json")
        if name.startswith("tp2"):
            record_residual_shapes(trainer.engine.module, Path(out_dir) / f"residual_{name}_rank{rank}.json")
    record_autotp_shapes(model_dir, Path(out_dir) / f"autotp_rank{rank}.json")
    # DeepSpeed keeps the AutoTP groups of the runs above: a deepspeed run without AutoTP is refused.
    try:
        SFTTrainer(
            sft_config(
                model_dir,
                train_file,
                Path(out_dir) / "deepspeed_after_autotp",
                AUTOTP2 | {"tensor_parallel_size": 1},
            )
        ).run()
    except RuntimeError as err:
        (Path(out_dir) / f"after_autotp_rank{rank}.txt").write_text(str(err))


@contextmanager
def counting_padded_chunks(path: Path) -> Iterator[None]:
    """Count the ring attention calls whose chunk came padded for tensor parallel's sequence split (an
    odd chunk over 2 ranks), and how many calls there were, into ``path``."""
    import json

    from raylign.models import sequence_parallel

    labels = sequence_parallel._labels_with_padding
    counts = {"calls": 0, "padded": 0}

    def counted(shard, length):
        counts["calls"] += 1
        counts["padded"] += int(length > shard.token_index.shape[1])
        return labels(shard, length)

    sequence_parallel._labels_with_padding = counted
    try:
        yield
    finally:
        sequence_parallel._labels_with_padding = labels
        path.write_text(json.dumps(counts))


def record_residual_shapes(module, path: Path) -> None:
    """The shape of the residual stream a norm of the first layer sees, and of the logits, in a forward of
    one row of 15 tokens (odd: the ranks cannot split it without padding)."""
    import json

    import torch

    shapes = {}
    norm = module.model.layers[0].post_attention_layernorm

    def record(_module, args) -> None:
        shapes["norm_input"] = list(args[0].shape)

    handle = norm.register_forward_pre_hook(record)
    with torch.no_grad():
        logits = module(input_ids=torch.arange(1, 16).unsqueeze(0)).logits
    handle.remove()
    shapes["logits"] = list(logits.shape)
    path.write_text(json.dumps(shapes))


def record_lora_blocks(module, path: Path) -> None:
    """How tensor parallel splits the first layer's q_proj (column-split) and o_proj (row-split): for the
    base weight and each adapter matrix, the dimension split over the pair, or "whole"."""
    import json

    from torch.distributed.tensor import DTensor, Shard

    blocks = {}
    for name, param in module.named_parameters():
        if ".layers.0." in name and ("q_proj" in name or "o_proj" in name):
            split = isinstance(param, DTensor) and len(param.placements) == 2  # (FSDP2's, tensor parallel's)
            tp = param.placements[-1] if split else None
            blocks[name.split(".layers.0.self_attn.")[1]] = f"Shard({tp.dim})" if isinstance(tp, Shard) else "whole"
    path.write_text(json.dumps(blocks))


def record_autotp_shapes(model_dir: str, path: Path) -> None:
    """The shapes this rank holds of a few weights once DeepSpeed AutoTP (2) has split the model."""
    import json

    from raylign.config.engine import EngineConfig
    from raylign.config.model import ModelConfig
    from raylign.config.optim import OptimConfig
    from raylign.engine import create_engine
    from raylign.models import load_causal_lm

    model = load_causal_lm(ModelConfig(path=model_dir, dtype="float32"))
    engine_cfg = EngineConfig(backend="deepspeed", zero_stage=1, tensor_parallel_size=2, dist_timeout_s=120)
    engine = create_engine(model, engine_cfg, OptimConfig(), total_steps=1)
    layer = engine.hf_model.model.layers[0]
    shapes = {"q_proj": layer.self_attn.q_proj.weight.shape, "down_proj": layer.mlp.down_proj.weight.shape}
    path.write_text(json.dumps({name: list(shape) for name, shape in shapes.items()}))
