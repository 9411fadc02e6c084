"""The ``hf`` rollout engine's sampling against transformers' own, on the same prompts, in one run.

Two sides, each in a child process of this script (so each has its own threads, allocator and
peak memory), on the same model, prompts and sampling (temperature 1, no top-k or top-p,
``--n`` samples a prompt, up to ``--max-new-tokens``), each returning every sampled token's
log-probability, as an RL rollout needs:

* ``raylign``: :class:`raylign.rollout.hf_engine.HFEngine` ``generate``, unseeded: one left-padded
  ``generate`` call whose tokens its own sampler picks, each sample from its own random stream;
* ``transformers``: ``model.generate(do_sample=True, output_scores=True)``, the log-probs gathered
  from the kept scores, the way to get them from transformers alone (it keeps a rows x vocabulary
  score per step until the end).

Printed, as medians over the repetitions after the first (warm-up): seconds per call, response
tokens per second, peak resident memory of the process, and the floor: the matrix products of
every position the call computes (prompt and every decoding step of every row, finished or not,
through the trunk; the output layer at each decoding step) at the matmul rate measured at the
start of the run on the threads the sides use. The samples differ between the sides (different
random draws), so tokens/s is the figure to compare, not seconds.

    python benchmarks/hf_generate.py                                  # SmolLM2, 16 prompts x 4, 64 tokens
    python benchmarks/hf_generate.py --max-new-tokens 256 --reps 2    # long answers
    python benchmarks/hf_generate.py --model tiny --threads 1
"""

from __future__ import annotations

import argparse
import json
import resource
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

SIDES = ("raylign", "transformers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = generation_arguments(__doc__.split("\n\n")[0], SIDES, max_new_tokens=64)
    return parser.parse_args(argv)


def prompt_ids(spec: dict[str, Any], tokenizer: Any) -> list[list[int]]:
    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines() if line.strip()]
    return [tokenizer(row["prompt"])["input_ids"] for row in rows]


def run_raylign(spec: dict[str, Any]) -> list[dict[str, float]]:
    import asyncio

    from raylign.config.rollout import RolloutConfig, SamplingConfig
    from raylign.rollout.hf_engine import HFEngine

    engine = HFEngine(spec["model"], RolloutConfig(engine="hf", dtype=spec["dtype"]))
    prompts = prompt_ids(spec, engine.tokenizer)
    sampling = SamplingConfig(n=spec["n"], temperature=1.0, max_new_tokens=spec["max_new_tokens"])
    records = []
    for _ in range(spec["reps"]):
        start = time.perf_counter()
        out = asyncio.run(engine.generate(prompts, sampling))
        seconds = time.perf_counter() - start
        steps = max(len(c.response_token_ids) for c in out)
        records.append(record(seconds, sum(len(c.response_token_ids) for c in out), steps))
    return records


def run_transformers(spec: dict[str, Any]) -> list[dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raylign.rollout.hf_engine import neutral_generation_config

    dtype = getattr(torch, spec["dtype"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
    model.generation_config = neutral_generation_config(model.generation_config)  # as the engine: no model defaults
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    prompts = prompt_ids(spec, tokenizer)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = next(iter(eos_ids)) if model.generation_config.pad_token_id is None else model.generation_config.pad_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    records = []
    for _ in range(spec["reps"]):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=spec["n"],
                max_new_tokens=spec["max_new_tokens"],
                output_scores=True,
                return_dict_in_generate=True,
            )
            responses = out.sequences[:, width:]
            scores = torch.stack([s.float() for s in out.scores], dim=1)
            logprobs = torch.log_softmax(scores, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        seconds = time.perf_counter() - start
        del out, scores, logprobs
        lengths = [next((t + 1 for t, tok in enumerate(row) if tok in eos_ids), len(row)) for row in responses.tolist()]
        records.append(record(seconds, sum(lengths), responses.shape[1]))
    return records


def record(seconds: float, tokens: int, steps: int) -> dict[str, float]:
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB
    return {"seconds": seconds, "tokens": tokens, "steps": steps, "peak_gb": peak_gb}


def run_side(side: str, spec_file: Path) -> None:
    spec = json.loads(spec_file.read_text())
    records = run_raylign(spec) if side == "raylign" else run_transformers(spec)
    write_steps(spec_file.parent, records)


def floor_s(sizes: dict[str, int], rows: int, width: int, steps: float, gflops: float) -> float:
    """Matrix-product seconds of a call: the trunk at every prompt and decoding position of every row
    (generate computes finished rows too), the output layer once per row and step."""
    flop = 2 * sizes["trunk"] * rows * (width + steps) + 2 * sizes["head"] * rows * steps
    return flop / (gflops * 1e9)


def body(args: argparse.Namespace, workdir: Path, load_before: tuple[float, ...]) -> list[dict[str, Any]]:
    from raylign.hardware import resolve_dtype

    dtype = resolve_dtype(args.dtype, "cpu")[0]
    hw = machine(dtype)
    threads = hw["cores"] if args.threads == "all" else 1
    model = prepare_model(args.model, workdir)
    prompts = write_prompts(workdir / "prompts.jsonl", args.prompts)
    spec = {
        "model": str(model),
        "prompts": str(prompts),
        "dtype": dtype,
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "reps": args.reps,
    }
    from transformers import AutoTokenizer

    width = max(len(ids) for ids in prompt_ids(spec, AutoTokenizer.from_pretrained(str(model))))
    sizes = model_sizes(str(model))
    rate = matmul_rate(hw, threads)
    print(
        f"{hw['cpu']} ({hw['capability']}; {', '.join(hw['flags'])}), {hw['cores']} cores, {dtype}, "
        f"{threads} thread(s) a side; matmul {rate:.1f} GFLOP/s on them; load average before "
        f"{load_before[0]:.2f}\n{args.model}: {args.prompts} prompts x {args.n} samples, up to "
        f"{args.max_new_tokens} new tokens, {args.reps} calls a side (medians after the first)\n"
    )
    print(f"{'side':<13s} {'s/call':>7s} {'tokens':>7s} {'tok/s':>7s} {'floor s':>7s} {'floor/s':>7s} {'peak GB':>7s}")
    rows = []
    for side in SIDES:
        result = launch(__file__, side, spec, workdir / side, env={"OMP_NUM_THREADS": str(threads)})
        if "error" in result:
            print(f"{side:<13s} failed: {result['error']} (log: {result['log']})")
            rows.append({"side": side, "errors": [result["error"]]})
            continue
        records = result["records"]
        seconds = median_after_warmup(records, "seconds")
        tokens = median_after_warmup(records, "tokens")
        floor = floor_s(sizes, args.prompts * args.n, width, median_after_warmup(records, "steps"), rate)
        peak = max(r["peak_gb"] for r in records)
        row = {
            "side": side,
            "errors": [],
            "records": records,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "floor_s": floor,
            "peak_gb": peak,
        }
        rows.append(row)
        print(
            f"{side:<13s} {fmt(seconds)} {tokens:7.0f} {fmt(tokens / seconds, 7, 1)} {fmt(floor)} "
            f"{fmt(floor / seconds, 7, 3)} {fmt(peak)}"
        )
    done = [row for row in rows if not row["errors"]]
    if len(done) == 2:
        print(f"\nraylign / transformers tokens/s: {done[0]['tokens_per_s'] / done[1]['tokens_per_s']:.2f}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"machine": hw, "threads": threads, "sizes": sizes, "width": width, "rows": rows})
        )
    return rows


if __name__ == "__main__":
    run_benchmark(parse_args, run_side, "hf-generate-", body)
