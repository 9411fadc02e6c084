"""Code run inside the 2 spawned gloo ranks of ``test_qlora_fsdp2.py``: SFT of LoRA adapters on a 4-bit
base with fsdp2 over both ranks, to the end, and again stopped after step 2 and resumed from its
checkpoint; with each packed row split over both ranks (sequence parallel 2); on deepspeed ZeRO-2, to the
end and resumed; and what each rank holds of the model."""

from __future__ import annotations

import json
from pathlib import Path

from tests.spawned_ranks import as_gloo_rank

WORLD_SIZE = 2
STEPS = 3


def sft_config(model_dir: str, train_file: str, out: Path, backend: str, steps: int = STEPS, **engine):
    """The tensor-parallel test's SFT run with a 4-bit base under LoRA, on ``backend``."""
    from tests.trainers.sft_tensor_parallel_worker import sft_config as tensor_parallel_sft_config

    lora = {"rank": 4, "alpha": 8, "quantize_base": "nf4"}
    return tensor_parallel_sft_config(
        model_dir, train_file, out, {"model": {"lora": lora}, "backend": backend, **engine}, steps
    )


def run_rank(rank: int, port: int, model_dir: str, train_file: str, out_dir: str) -> None:
    from raylign.trainers.sft import SFTTrainer

    out = Path(out_dir)
    as_gloo_rank(rank, WORLD_SIZE, port)
    trainer = SFTTrainer(sft_config(model_dir, train_file, out / "fsdp2", "fsdp2"))
    trainer.run()
    record_holdings(trainer.engine.module, out / f"holdings_rank{rank}.json")
    SFTTrainer(sft_config(model_dir, train_file, out / "fsdp2_resumed", "fsdp2", steps=2)).run()
    SFTTrainer(sft_config(model_dir, train_file, out / "fsdp2_resumed", "fsdp2")).run()
    SFTTrainer(sft_config(model_dir, train_file, out / "fsdp2_sp2", "fsdp2", sequence_parallel_size=2)).run()
    SFTTrainer(sft_config(model_dir, train_file, out / "deepspeed", "deepspeed", zero_stage=2)).run()
    SFTTrainer(sft_config(model_dir, train_file, out / "deepspeed_resumed", "deepspeed", steps=2, zero_stage=2)).run()
    SFTTrainer(sft_config(model_dir, train_file, out / "deepspeed_resumed", "deepspeed", zero_stage=2)).run()


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
