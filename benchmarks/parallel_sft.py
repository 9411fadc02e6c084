"""SFT tokens/s and peak memory per rank under each parallel layout, on the same model and data.

Runs ``raylign sft`` (fsdp2, ``--engine.num_processes 4``) once per layout, each in its own
processes, on one small model built locally and the same training rows, and prints per layout the
median tokens/s of the steps after the first, the peak memory of the rank that held the most
(``train/peak_memory_gib``: on the CPU the process's peak resident size, interpreter and libraries
included), the last step's loss, and the estimate of ``raylign estimate-memory`` for that layout
beside it. Layouts: data parallel over 4 ranks, tensor parallel 2 (a 2 x 2 mesh) and 4, sequence
parallel 2 and 4 (ring attention over packed rows), hybrid sharding 2 x 2, tensor parallel 2
with sequence parallel 2 (each row's 2 chunks split over 2 ranks each), and sequence parallel 2 and 4
with Ulysses attention (``sp2u``, ``sp4u``) in place of the ring.

    python benchmarks/parallel_sft.py                  # 6 steps per layout
    python benchmarks/parallel_sft.py --steps 4 --layouts dp4,tp2,sp2

Four ranks on a 2-core machine share the cores: every layout pays the same oversubscription, so
compare the layouts with each other within one run, not with a machine that has a core per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from child_runs import CHILD_ENV, REPO, machine

LAYOUTS = {
    "dp4": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp4": {"tensor_parallel_size": 4},
    "sp2": {"sequence_parallel_size": 2},
    "sp4": {"sequence_parallel_size": 4},
    "hsdp2x2": {"data_parallel_shard_size": 2},
    "tp2sp2": {"tensor_parallel_size": 2, "sequence_parallel_size": 2},
    "sp2u": {"sequence_parallel_size": 2, "sequence_parallel_mode": "ulysses"},
    "sp4u": {"sequence_parallel_size": 4, "sequence_parallel_mode": "ulysses"},
}
RANKS = 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per layout; the first is warm-up")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--hidden", type=int, default=512, help="width of the model (4 heads of hidden / 4)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    parser.add_argument("--rows", type=int, default=64, help="training rows (a string task, about 60 tokens each)")
    parser.add_argument("--json", type=Path, help="also write every layout's figures to this file")
    return parser.parse_args()


def run_layout(name: str, engine: dict, model: Path, train: Path, out: Path, steps: int) -> dict:
    """``raylign sft`` with this layout; its step records."""
    command = [sys.executable, "-m", "raylign.cli.main", "sft", "--model.path", str(model)]
    command += ["--model.dtype", "float32", "--data.train", json.dumps([str(train)]), "--data.format", "chat"]
    command += ["--engine.backend", "fsdp2", "--engine.num_processes", str(RANKS)]
    for key, value in engine.items():
        command += [f"--engine.{key}", str(value)]
    command += ["--train.output_dir", str(out), "--train.max_steps", str(steps), "--train.global_batch_size", "8"]
    command += ["--train.micro_batch_size", "2", "--train.export", "false", "--train.logging.progress_bar", "false"]
    command += ["--train.logging.tensorboard", "false"]
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"layout {name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"records": [r for r in records if "train/loss" in r]}


def bare_process_gib() -> float:
    """Peak resident size of a process that imports what a training rank imports and does nothing else."""
    code = (
        "import resource, torch, transformers, raylign.trainers.sft; "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30)"
    )
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the first step is warm-up")
    names = args.layouts.split(",")
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; known: {', '.join(LAYOUTS)}")
    import yaml  # noqa: F401 - the config files the runs write

    from raylign.engine.memory import Layout, ModelShape, estimate_training_memory
    from raylign.models.tiny import build_tiny_model
    from raylign.tasks.strings import make_string_rows

    hw = machine("float32")
    print(
        f"machine: {hw['cpu']} ({hw['capability']}, {' '.join(hw['flags'])}), {hw['cores']} cores; "
        f"fp32 matmul {hw['matmul_gflops_1thread']:.0f} GFLOP/s on one thread; {RANKS} ranks per layout"
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="raylign-parallel-") as scratch:
        root = Path(scratch)
        model = build_tiny_model(
            root / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=4
        )
        train = root / "train.jsonl"
        rows = make_string_rows("reverse", args.rows, seed=0)
        train.write_text("".join(json.dumps(row) + "\n" for row in rows))
        from transformers import AutoConfig

        shape = ModelShape.from_config(AutoConfig.from_pretrained(str(model)))
        for name in names:
            engine = LAYOUTS[name]
            records = run_layout(name, engine, model, train, root / name, args.steps)["records"]
            tokens_s = statistics.median(r["train/tokens_per_s"] for r in records[1:])
            layout = Layout(
                dtype="float32",
                backend="fsdp2",
                ranks=RANKS,
                tensor_parallel=engine.get("tensor_parallel_size", 1),
                sequence_parallel=engine.get("sequence_parallel_size", 1),
                micro_batch_tokens=2 * 64,
            )
            estimate = estimate_training_memory(shape, layout).total / (1 << 30)
            results[name] = {
                "tokens_per_s": tokens_s,
                "peak_memory_gib": max(r["train/peak_memory_gib"] for r in records),
                "last_loss": records[-1]["train/loss"],
                "estimated_tensors_gib": estimate,
            }
            print(f"  {name}: {tokens_s:.0f} tokens/s", flush=True)
    size = f"{shape.params() / 1e6:.1f}M-parameter model"
    print(f"\nSFT of a {size}, fp32, {RANKS} ranks, medians of steps 2..{args.steps}:")
    header = ("layout", "tokens/s", "vs dp4", "peak GiB", "above bare", "estimate GiB", "last loss")
    print("  ".join(f"{h:>12s}" for h in header))
    base = results.get("dp4", next(iter(results.values())))["tokens_per_s"]
    bare = bare_process_gib()
    for name, r in results.items():
        cells = (
            f"{r['tokens_per_s']:12.0f}",
            f"{r['tokens_per_s'] / base:12.2f}",
            f"{r['peak_memory_gib']:12.2f}",
            f"{r['peak_memory_gib'] - bare:12.3f}",
            f"{r['estimated_tensors_gib']:12.3f}",
            f"{r['last_loss']:12.4f}",
        )
        print(f"{name:>12s}  " + "  ".join(cells))
    print(
        f"peak GiB: the rank's peak resident size on the CPU; above bare: less the {bare:.2f} GiB a process with the "
        "same imports and nothing else holds; estimate GiB: the tensors, by raylign estimate-memory"
    )
    if args.json:
        args.json.write_text(json.dumps({"machine": hw, "layouts": results}, indent=1))


if __name__ == "__main__":
    main()
