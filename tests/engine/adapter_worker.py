"""Code run inside the 2 spawned gloo ranks of ``test_engine_adapter.py``: one LoRA model per backend
(fsdp2, ZeRO-2, ZeRO-3), each sharded over both ranks; rank 0 saves what ``adapter_state_dict``
gathered and what ``iter_full_state`` streamed (the weights merged layer by layer), rank 1 what both
gave it with ``every_rank``."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.spawned_ranks import as_gloo_rank

WORLD_SIZE = 2
BACKENDS = {
    "fsdp2": {"backend": "fsdp2"},
    "zero2": {"backend": "deepspeed", "zero_stage": 2},
    "zero3": {"backend": "deepspeed", "zero_stage": 3},
}


def lora_model(seed: int = 0) -> torch.nn.Module:
    """The tiny engine-test model with LoRA on q, v and up; B random, as after training."""
    from peft import LoraConfig, get_peft_model

    from tests.engine.engine_testing import tiny_model

    model = get_peft_model(
        tiny_model(seed), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    )
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    return model


def run_rank(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from raylign.config.engine import EngineConfig
    from raylign.config.optim import OptimConfig
    from raylign.engine import create_engine

    as_gloo_rank(rank, WORLD_SIZE, port)
    for name, fields in BACKENDS.items():
        engine = create_engine(lora_model(), EngineConfig(**fields, dist_timeout_s=120), OptimConfig(lr=1e-2), 2)
        weights, config = engine.adapter_state_dict()
        # What a merged-weight sync sends, as it streams: each tensor copied and dropped on arrival.
        streamed = {key: tensor.clone() for key, tensor in engine.iter_full_state()}
        if rank == 0:
            save_file(weights, Path(out_dir) / f"{name}.safetensors", metadata={"r": str(config["r"])})
            torch.save({"names": list(streamed), "tensors": streamed}, Path(out_dir) / f"{name}_merged.pt")
        else:
            assert weights == {} and streamed == {}, f"{name}: rank {rank} got weights"
        # What colocated engines load: the same on every rank.
        weights, _ = engine.adapter_state_dict(every_rank=True)
        streamed = {key: tensor.clone() for key, tensor in engine.iter_full_state(every_rank=True)}
        if rank == WORLD_SIZE - 1:
            save_file(weights, Path(out_dir) / f"{name}_every_rank.safetensors")
            torch.save({"names": list(streamed), "tensors": streamed}, Path(out_dir) / f"{name}_merged_every_rank.pt")
        dist.barrier()
