"""One rank of an FSDP2 model loaded whole (``--mode full``), shard by shard (``--mode sharded``), or
both one after the other in the same processes (``--mode both``, one launch where memory is not measured).

Run under ``python -m torch.distributed.run --nproc_per_node N`` (``--tensor-parallel T``: the matrices split
over groups of T ranks as well, the FSDP2 shards over the rest). Each rank measures how far its resident
memory rose while the model was loaded and sharded (the high-water mark ``ru_maxrss`` against the resident
size before; under ``both`` for the first load only, ``None`` for the second), then all ranks train one step
on a fixed batch and rank 0 gathers the weights as they were loaded and writes ``<out>/<mode>.json`` and
``<out>/<mode>.pt``.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch
import torch.distributed as dist

from raylign.config.engine import EngineConfig
from raylign.config.model import ModelConfig
from raylign.config.optim import OptimConfig
from raylign.engine import create_engine, init_distributed
from raylign.engine.distributed import exit_process
from raylign.models import load_causal_lm


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["full", "sharded", "both"], required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=0)
    args = parser.parse_args()
    init_distributed(600)
    for n, mode in enumerate(["full", "sharded"] if args.mode == "both" else [args.mode]):
        load_and_step(args, mode, measures_memory=n == 0)
    exit_process(0)


def load_and_step(args: argparse.Namespace, mode: str, measures_memory: bool) -> None:
    rank = dist.get_rank()
    sharded = mode == "sharded"
    before = resident_bytes()
    torch.manual_seed(0)  # the process's seed, from which LoRA adapters are drawn
    model_cfg = ModelConfig(path=args.model_dir, dtype="float32", lora={"rank": args.lora_rank})
    model = load_causal_lm(model_cfg, empty=sharded)
    engine = create_engine(
        model,
        EngineConfig(backend="fsdp2", load_sharded=sharded, tensor_parallel_size=args.tensor_parallel),
        OptimConfig(lr=1e-3),
        total_steps=1,
    )
    rise = peak_resident_bytes() - before if measures_memory else None
    weights = engine.full_state_dict()  # collective: every rank takes part
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = engine.module(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    metrics = engine.step()
    adapters = engine.adapter_state_dict()[0] if args.lora_rank else {}  # after the step: B is no longer 0
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"rise": rise, "bytes_read": getattr(engine, "bytes_read", None)})
    if rank == 0:
        out = Path(args.out)
        torch.save(weights, out / f"{mode}.pt")
        torch.save(adapters, out / f"{mode}_adapters.pt")
        result = {"ranks": ranks, "loss": loss.item(), "grad_norm": metrics["grad_norm"]}
        (out / f"{mode}.json").write_text(json.dumps(result))
    dist.barrier()  # every rank goes on once rank 0 has written


if __name__ == "__main__":
    main()
