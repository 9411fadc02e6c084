"""A vLLM rollout engine's start, generation and stop on CPU: raylign's executor against vLLM's default.

Two sides, each in a child process of this script, on the same model, prompts and sampling
(temperature 1, seeded, ``--n`` samples a prompt, up to ``--max-new-tokens``), through raylign's
:class:`~raylign.rollout.vllm_engine.VLLMEngine` (vLLM's ``AsyncLLM``), which differ in one setting:

* ``raylign``: the model's worker runs inside vLLM's engine-core process
  (``vllm_engine.CPU_EXECUTOR``) and computes with the process's ``OMP_NUM_THREADS``;
* ``vllm-default``: vLLM's CPU default, which starts the worker as a process of its own (one more
  process importing vLLM and torch) and binds its OpenMP threads to every core of its NUMA node,
  whatever ``OMP_NUM_THREADS`` says.

Printed per side: seconds to start (the engine built, its model loaded), the floor beside it (one
fresh ``import vllm``, measured at the start of the run: what a process of vLLM's own costs before
anything of the engine happens), the torch threads the worker computes with, generation tokens/s as
the median over the calls after the first (warm-up) with the matrix-product floor of those tokens at
the matmul rate measured on that many threads, and seconds to stop.

    python benchmarks/vllm_engine_start.py --dtype float32                # SmolLM2, every core
    python benchmarks/vllm_engine_start.py --dtype float32 --threads 1    # what an engine beside training gets
    python benchmarks/vllm_engine_start.py --model tiny --reps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from child_runs import (
    fmt,
    generation_arguments,
    launch,
    machine,
    matmul_rate,
    median_after_warmup,
    run_benchmark,
    write_steps,
)
from grpo_vs_trl import model_sizes, prepare_model, write_prompts

SIDES = ("raylign", "vllm-default")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = generation_arguments(__doc__.split("\n\n")[0], SIDES, max_new_tokens=128)
    return parser.parse_args(argv)


def run_side(side: str, spec_file: Path) -> None:
    import asyncio

    from raylign.config.rollout import RolloutConfig, SamplingConfig
    from raylign.rollout import vllm_engine

    spec = json.loads(spec_file.read_text())
    if side == "vllm-default":
        vllm_engine.CPU_EXECUTOR = None  # vLLM chooses, as without raylign's setting

    async def body() -> dict[str, Any]:
        config = RolloutConfig(engine="vllm", dtype=spec["dtype"], max_model_len=spec["max_model_len"])
        start = time.perf_counter()
        engine = vllm_engine.VLLMEngine(spec["model"], config)
        [worker] = await engine.worker_compute()  # the engine answers once its model is loaded
        start_s = time.perf_counter() - start
        sampling = SamplingConfig(n=spec["n"], temperature=1.0, max_new_tokens=spec["max_new_tokens"], seed=0)
        records = []
        for _ in range(spec["reps"]):
            start = time.perf_counter()
            out = await engine.generate(spec["prompt_ids"], sampling)
            seconds = time.perf_counter() - start
            records.append({"seconds": seconds, "tokens": sum(len(c.response_token_ids) for c in out)})
        start = time.perf_counter()
        await engine.shutdown()
        stop_s = time.perf_counter() - start
        return {"start_s": start_s, "stop_s": stop_s, "threads": worker["threads"], "records": records}

    result = asyncio.run(body())
    write_steps(spec_file.parent, result.pop("records"), **result)


def import_floor_s(repeats: int = 1) -> float:
    """Seconds a fresh process takes to import vLLM (and torch with it): the median of ``repeats``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import vllm"], check=True, timeout=300, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def body(args: argparse.Namespace, workdir: Path, load_before: tuple[float, ...]) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from raylign.hardware import resolve_dtype

    dtype = resolve_dtype(args.dtype, "cpu")[0]
    hw = machine(dtype)
    threads = hw["cores"] if args.threads == "all" else 1
    model = prepare_model(args.model, workdir)
    prompt_file = write_prompts(workdir / "prompts.jsonl", args.prompts)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rows_in = [json.loads(line) for line in prompt_file.read_text().splitlines() if line.strip()]
    prompt_ids = [tokenizer(row["prompt"])["input_ids"] for row in rows_in]
    spec = {
        "model": str(model),
        "prompt_ids": prompt_ids,
        "dtype": dtype,
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "max_model_len": max(len(p) for p in prompt_ids) + args.max_new_tokens,
        "reps": args.reps,
    }
    sizes = model_sizes(str(model))
    rate = matmul_rate(hw, threads)
    floor_import = import_floor_s()
    print(
        f"{hw['cpu']} ({hw['capability']}; {', '.join(hw['flags'])}), {hw['cores']} cores, {dtype}, "
        f"OMP_NUM_THREADS={threads}; matmul {rate:.1f} GFLOP/s on {threads} thread(s); a fresh `import vllm` "
        f"{floor_import:.1f} s; load average before {load_before[0]:.2f}\n{args.model}: {args.prompts} prompts x "
        f"{args.n} samples, up to {args.max_new_tokens} new tokens, {args.reps} calls a side (medians after the "
        "first)\n"
    )
    print(f"{'side':<13s} {'start s':>7s} {'import':>7s} {'threads':>7s} {'tok/s':>7s} {'floor':>7s} {'stop s':>7s}")
    prompt_tokens = sum(len(p) for p in prompt_ids)
    rows = []
    for side in SIDES:
        result = launch(__file__, side, spec, workdir / side, env={"OMP_NUM_THREADS": str(threads)})
        if "error" in result:
            print(f"{side:<13s} failed: {result['error']} (log: {result['log']})")
            rows.append({"side": side, "errors": [result["error"]]})
            continue
        seconds = median_after_warmup(result["records"], "seconds")
        tokens = median_after_warmup(result["records"], "tokens")
        # Matrix products only: the trunk once per prompt token (its samples share the prefix) and
        # trunk and output layer per sampled token.
        flop = 2 * sizes["trunk"] * prompt_tokens + 2 * (sizes["trunk"] + sizes["head"]) * tokens
        floor_tok_s = tokens / (flop / (rate * 1e9))
        row = {
            "side": side,
            "errors": [],
            **result,
            "tokens_per_s": tokens / seconds,
            "floor_tokens_per_s": floor_tok_s,
        }
        rows.append(row)
        print(
            f"{side:<13s} {fmt(result['start_s'], 7, 1)} {fmt(floor_import, 7, 1)} {result['threads']:7d} "
            f"{fmt(tokens / seconds, 7, 1)} {fmt(floor_tok_s, 7, 0)} {fmt(result['stop_s'], 7, 1)}"
        )
    done = {row["side"]: row for row in rows if not row["errors"]}
    if len(done) == 2:
        ours, theirs = done["raylign"], done["vllm-default"]
        print(
            f"\nraylign starts {theirs['start_s'] - ours['start_s']:.1f} s sooner, stops "
            f"{theirs['stop_s'] - ours['stop_s']:.1f} s sooner; tokens/s ratio "
            f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f} (raylign / vLLM's default)"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "machine": hw,
                    "threads": threads,
                    "import_floor_s": floor_import,
                    "sizes": sizes,
                    "prompt_tokens": prompt_tokens,
                    "rows": rows,
                }
            )
        )
    return rows


if __name__ == "__main__":
    run_benchmark(parse_args, run_side, "vllm-engine-start-", body)
