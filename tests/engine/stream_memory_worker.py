"""One rank of an FSDP2 (or ZeRO-3, or FSDP2 LoRA) policy measuring what a weight sync's gather costs
in resident memory.

Run under ``python -m torch.distributed.run --nproc_per_node 2``. Each rank measures how far its
resident memory rises (Linux's VmHWM, reset through ``/proc/self/clear_refs`` before each
measurement, against VmRSS at that moment) while it iterates :meth:`TrainEngine.iter_full_state`
to the end, dropping every tensor as it arrives (as the bucket packer does), and then while it
takes :meth:`TrainEngine.full_state_dict` (what a sync held before the stream). Each is run once
untimed first, so that lazy imports and allocator set-up do not count. Rank 0 writes
``<out>/stream_memory_<backend>.json`` with every rank's figures and the sizes of the streamed tensors,
for each backend of ``--backends`` in turn (one launch for all).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist

from raylign.config.engine import EngineConfig
from raylign.config.model import ModelConfig
from raylign.config.optim import OptimConfig
from raylign.engine import create_engine, init_distributed
from raylign.engine.distributed import exit_process
from raylign.models import load_causal_lm
from tests.engine.memory_probe import resident


def rise_while(action) -> int:
    """How far the resident high-water mark rose above the resident size while ``action()`` ran."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident size
    before = resident("VmRSS:")
    action()
    return resident("VmHWM:") - before


def measure(backend: str, model_dir: str, out: Path) -> None:
    lora = {"rank": 8, "alpha": 16.0} if backend == "lora" else {}
    model = load_causal_lm(ModelConfig(path=model_dir, dtype="float32", lora=lora))
    fields = {"backend": "deepspeed", "zero_stage": 3} if backend == "zero3" else {"backend": "fsdp2"}
    engine = create_engine(model, EngineConfig(**fields), OptimConfig(lr=1e-3), total_steps=1)
    sizes: list[int] = []

    def stream() -> None:
        sizes.clear()
        for _, tensor in engine.iter_full_state():
            sizes.append(tensor.numel() * tensor.element_size())
            del tensor

    def whole() -> None:
        state = engine.full_state_dict()
        del state

    stream()
    stream_rise = rise_while(stream)
    whole()
    whole_rise = rise_while(whole)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"stream_rise": stream_rise, "whole_rise": whole_rise})
    if dist.get_rank() == 0:
        result = {"ranks": ranks, "largest": max(sizes), "total": sum(sizes), "tensors": len(sizes)}
        (out / f"stream_memory_{backend}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--backends",
        default="fsdp2",
        help="comma-separated, measured one after the other: fsdp2, lora (fsdp2, LoRA merged), zero3 (deepspeed; "
        "last, since DeepSpeed keeps global state)",
    )
    args = parser.parse_args()
    init_distributed(600)
    torch.set_num_threads(1)
    for backend in args.backends.split(","):
        # Each measurement is a rise above the resident size at its start: what an earlier engine left
        # behind only raises that start.
        measure(backend, args.model_dir, Path(args.out))
        gc.collect()
    dist.barrier()  # every rank ends once rank 0 has written
    exit_process(0)


if __name__ == "__main__":
    main()
