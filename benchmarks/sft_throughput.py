"""SFT tokens/s for the local, fsdp2 and deepspeed backends, with packing on and off.

Runs the real `raylign sft` command on one small random model and a synthetic data set of
variable-length samples, then reads each run's metrics. Tokens/s counts non-padding
tokens, so padding waste shows up as lower throughput. The first step (warm-up) is left out.

    python benchmarks/sft_throughput.py                       # all six runs
    python benchmarks/sft_throughput.py --backends local --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from child_runs import DTYPE_HELP

from raylign.hardware import resolve_dtype
from raylign.models.tiny import build_tiny_model
from raylign.trainers.metrics import read_metrics

WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "by",
    "this",
    "are",
    "or",
    "from",
    "at",
    "answer",
    "step",
    "number",
    "total",
]


def write_data(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
            completion = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 180)))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def run(model: Path, data: Path, out: Path, backend: str, packing: bool, steps: int, batch: int, dtype: str) -> dict:
    procs = 1 if backend == "local" else 2
    cmd = [
        sys.executable,
        "-m",
        "raylign.cli.main",
        "sft",
        "--model.path",
        str(model),
        "--model.dtype",
        dtype,
        "--data.train",
        str(data),
        "--data.max_length",
        "512",
        "--data.packing",
        str(packing).lower(),
        "--engine.backend",
        backend,
        "--engine.num_processes",
        str(procs),
        "--engine.zero_stage",
        "2",
        "--train.output_dir",
        str(out),
        "--train.max_steps",
        str(steps),
        "--train.global_batch_size",
        str(batch),
        "--train.micro_batch_size",
        str(batch // procs),
        "--train.export",
        "false",
        "--train.resume",
        "false",
        "--train.logging.progress_bar",
        "false",
        "--train.logging.tensorboard",
        "false",
        "--optim.lr",
        "1e-4",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    records = [r for r in read_metrics(out) if "train/tokens_per_s" in r and r["step"] > 1]
    return {
        "tokens_per_s": statistics.median(r["train/tokens_per_s"] for r in records),
        "step_time_s": statistics.median(r["train/step_time_s"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="local,fsdp2,deepspeed", help="comma-separated backends")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=16, help="global batch size (samples)")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help=DTYPE_HELP)
    args = parser.parse_args()
    args.dtype, reason = resolve_dtype(args.dtype, "cpu")
    print(f"dtype {args.dtype} ({reason})")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(
            tmp / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=8,
            num_kv_heads=4,
            max_position_embeddings=1024,
        )
        data = write_data(tmp / "train.jsonl", rows=args.batch * (args.steps + 1))
        rows = []
        for backend in args.backends.split(","):
            for packing in (True, False):
                result = run(
                    model, data, tmp / f"{backend}-{packing}", backend, packing, args.steps, args.batch, args.dtype
                )
                rows.append((backend, "on" if packing else "off", result))
                print(
                    f"  done: {backend:9s} packing {rows[-1][1]:3s} {result['tokens_per_s']:9.0f} tokens/s", flush=True
                )
    print(
        f"\nSFT throughput, model {args.hidden}x{args.layers} ({args.dtype}), global batch {args.batch}, "
        f"{args.steps} steps, 2 ranks for sharded backends"
    )
    print(f"{'backend':10s} {'packing':8s} {'tokens/s':>10s} {'s/step':>8s}")
    for backend, packing, r in rows:
        print(f"{backend:10s} {packing:8s} {r['tokens_per_s']:10.0f} {r['step_time_s']:8.2f}")


if __name__ == "__main__":
    main()
