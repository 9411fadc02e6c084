"""Activation memory per rank under tensor parallel, with the activations between the split matrices
whole on every rank or split along the sequence (``engine.tensor_parallel_shard_activations``).

Each layout runs in its own ``torchrun`` of 4 gloo ranks (fsdp2): one forward of one row on a model
built locally, counting the bytes of every tensor autograd saves for the backward (distinct storages,
the model's own parameters left out), then the backward; rank 0 prints its figure, its forward and
backward seconds, and the activations ``raylign estimate-memory`` counts for the same layout.

    python benchmarks/tp_activation_memory.py
    python benchmarks/tp_activation_memory.py --tokens 4096 --hidden 1024

The saved bytes include what the layout's gathers keep (FSDP2's gathered weights while a layer runs,
the projections' gathered inputs) and the logits; compare the layouts with each other within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from child_runs import CHILD_ENV, REPO, machine

RANKS = 4
LAYOUTS = {  # name -> (tensor parallel, activations split along the sequence, gradient checkpointing)
    "data parallel 4": (1, False, False),
    "tp 2, activations whole": (2, False, False),
    "tp 2, activations split": (2, True, False),
    "tp 2, checkpointing, activations whole": (2, False, True),
    "tp 2, checkpointing, activations split": (2, True, True),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="length of the one row of the forward")
    parser.add_argument("--hidden", type=int, default=512, help="model width (heads of 64, half as many key/value)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "TP", "SPLIT", "CHECKPOINTING"), help=argparse.SUPPRESS)
    return parser.parse_args()


def child(model: str, tp: int, split: bool, checkpointing: bool, tokens: int) -> None:
    """One rank: the saved bytes of one forward, then its backward; rank 0 prints a JSON line."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from raylign.config.engine import EngineConfig
    from raylign.config.model import ModelConfig
    from raylign.config.optim import OptimConfig
    from raylign.engine import create_engine, init_distributed
    from raylign.engine.distributed import exit_process
    from raylign.models import load_causal_lm

    init_distributed(600)
    model_cfg = ModelConfig(path=model, dtype="float32", gradient_checkpointing=checkpointing)
    engine_cfg = EngineConfig(backend="fsdp2", tensor_parallel_size=tp, tensor_parallel_shard_activations=split)
    engine = create_engine(load_causal_lm(model_cfg, empty=True), engine_cfg, OptimConfig(), total_steps=1)
    ids = torch.randint(0, engine.module.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    storages: dict[int, int] = {}

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor._local_tensor if isinstance(tensor, DTensor) else tensor

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = local(tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # a tensor without storage of its own (a wrapper); what it wraps is counted
            pass
        return tensor

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = engine.module(input_ids=ids).logits.float().pow(2).mean()
    params = {local(p).untyped_storage().data_ptr() for p in engine.module.parameters()}
    saved = sum(size for pointer, size in storages.items() if pointer not in params)
    loss.backward()
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(json.dumps({"saved_bytes": saved, "seconds": seconds}), flush=True)
    # The group stays alive until the process ends: destroying it can hang (see exit_process).
    exit_process(0)


def estimate(hidden: int, layers: int, tokens: int, tp: int, split: bool, checkpointing: bool) -> float:
    """``raylign estimate-memory``'s activations for the model and layout, in bytes (fp32)."""
    from raylign.engine.memory import Layout, ModelShape, estimate_training_memory

    shape = ModelShape(
        hidden=hidden, layers=layers, heads=hidden // 64, kv_heads=hidden // 128, intermediate=3 * hidden, vocab=1000
    )
    layout = Layout(
        dtype="float32", ranks=RANKS, tensor_parallel=tp, micro_batch_tokens=tokens,
        gradient_checkpointing=checkpointing, shard_activations=split,
    )  # fmt: skip
    return estimate_training_memory(shape, layout).device["activations"]


def main() -> None:
    args = parse_args()
    if args.child:
        model, tp, split, checkpointing = args.child
        child(model, int(tp), split == "1", checkpointing == "1", args.tokens)
        return
    from raylign.models.tiny import build_tiny_model

    info = machine("float32")
    print(
        f"{info['cpu']} ({', '.join(info['flags'])}; torch capability {info['capability']}), {info['cores']} cores, "
        f"fp32 matmul {info['matmul_gflops_1thread']:.0f} GFLOP/s on one thread; {RANKS} ranks share them"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
            num_kv_heads=args.hidden // 128, intermediate_size=3 * args.hidden, vocab_size=1000,
        )  # fmt: skip
        print(f"model: hidden {args.hidden}, {args.layers} layers, one row of {args.tokens} tokens\n")
        print("| layout | saved for backward, MiB | estimated activations, MiB | forward + backward s |")
        print("|---|---|---|---|")
        env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(REPO)}
        for name, (tp, split, checkpointing) in LAYOUTS.items():
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS)]
            command += [__file__, "--tokens", str(args.tokens), "--child", str(model), str(tp)]
            command += [str(int(split)), str(int(checkpointing))]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                raise SystemExit(f"{name}: the ranks failed\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
            figures = json.loads(lines[-1])
            estimated = estimate(args.hidden, args.layers, args.tokens, tp, split, checkpointing)
            print(
                f"| {name} | {figures['saved_bytes'] / 2**20:.1f} | {estimated / 2**20:.1f} | "
                f"{figures['seconds']:.2f} |"
            )


if __name__ == "__main__":
    main()
