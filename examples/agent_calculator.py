"""Multi-turn RL with a calculator tool: a tiny model learns to call the tool for products of two
3-digit numbers, which it cannot multiply itself.

    python examples/agent_calculator.py                # about 6-7 minutes on 2 CPU cores
    python examples/agent_calculator.py --help

1. Builds a small random Qwen2 model (locally trained tokenizer, nothing downloaded).
2. SFT warm-up on transcripts of a teacher that calls the calculator for only some of the
   questions (``--tool-fraction``) and otherwise guesses the product rounded to thousands::

       user:       347 * 829 = ?
       assistant:  <calculator>347 * 829</calculator>
       tool:       287663
       assistant:  287663

   or else ``347 * 829 = 287000``, so the warmed-up model knows the call format and how to copy
   numbers, but mostly guesses.
3. GRPO on agent episodes of :class:`raylign.agents.tools.CalculatorEnv`: the policy's turns are
   trained on, the tool's output is masked, and the reward is 1 for the exact product. Guesses
   are almost never exact, so the policy learns to call the tool.

The held-out questions are answered greedily before and after RL; ``summary.json`` holds the
success and tool-use rates, and the run's ``metrics.jsonl`` and ``trajectories.jsonl`` every step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from pathlib import Path

log = logging.getLogger("raylign")

ENV = "raylign.agents.tools:CalculatorEnv"
ENV_ARGS = {"system_prompt": "", "call_format": "tagged", "max_tool_calls": 2}


def questions(count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(count)]


def teacher_transcript(a: int, b: int, uses_tool: bool) -> list[dict[str, str]]:
    """The warm-up's conversation for ``a * b``: with the tool, or the question repeated with a guess
    rounded to thousands (so that copying the numbers is learnt from every transcript)."""
    user = {"role": "user", "content": f"{a} * {b} = ?"}
    if not uses_tool:
        return [user, {"role": "assistant", "content": f"{a} * {b} = {round(a * b, -3)}"}]
    return [
        user,
        {"role": "assistant", "content": f"<calculator>{a} * {b}</calculator>"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_data(out: Path, tool_fraction: float, seed: int) -> tuple[Path, Path, Path]:
    """SFT transcripts, RL training questions and held-out questions (no pair shared between them)."""
    pairs = list(dict.fromkeys(questions(4000, seed)))
    rng = random.Random(seed + 1)
    sft = [{"messages": teacher_transcript(a, b, rng.random() < tool_fraction)} for a, b in pairs[:2000]]
    as_prompts = [{"prompt": f"{a} * {b} = ?", "label": a * b} for a, b in pairs[2000:]]
    return (
        write_jsonl(sft, out / "data" / "sft.jsonl"),
        write_jsonl(as_prompts[:-64], out / "data" / "rl_prompts.jsonl"),
        write_jsonl(as_prompts[-64:], out / "data" / "eval_prompts.jsonl"),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--output-dir", default="outputs/agent_calculator", help="where data, models and logs go")
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT warm-up steps (batches of 32 transcripts)")
    parser.add_argument(
        "--tool-fraction", type=float, default=0.25, help="share of warm-up transcripts that use the tool"
    )
    parser.add_argument("--rl-steps", type=int, default=16, help="GRPO steps")
    parser.add_argument("--eval-every", type=int, default=8, help="greedy held-out evaluation every this many steps")
    parser.add_argument("--prompts-per-step", type=int, default=16, help="questions per GRPO step")
    parser.add_argument("--samples-per-prompt", type=int, default=4, help="episodes per question (GRPO group)")
    parser.add_argument("--rl-lr", type=float, default=5e-4, help="GRPO learning rate")
    parser.add_argument("--hidden-size", type=int, default=128, help="width of the tiny model (2 layers)")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="rollout engine")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, model and sampling")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from raylign.config.base import parse_config
    from raylign.config.commands import SFTConfig
    from raylign.config.rl import RLConfig
    from raylign.models.tiny import build_tiny_model
    from raylign.rl.trainer import RLTrainer
    from raylign.trainers.metrics import read_metrics
    from raylign.trainers.sft import SFTTrainer

    start = time.perf_counter()
    out = Path(args.output_dir)
    sft_file, prompts, held_out = write_data(out, args.tool_fraction, args.seed)
    model = build_tiny_model(
        out / "base_model",
        hidden_size=args.hidden_size,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=False,
        seed=args.seed,
    )
    log.info("SFT warm-up: %d steps, %.0f%% of the transcripts use the tool", args.sft_steps, 100 * args.tool_fraction)
    sft = {
        "model": {"path": str(model), "dtype": "float32"},
        # Unpacked rows: short transcripts packed into one long row pay for attention across all of them.
        "data": {"train": [str(sft_file)], "max_length": 96, "seed": args.seed, "packing": False},
        "optim": {"lr": 3e-3, "warmup_steps": min(10, args.sft_steps)},
        "train": {
            "output_dir": str(out / "sft"),
            "max_steps": args.sft_steps,
            "global_batch_size": 32,
            "micro_batch_size": 32,
            "seed": args.seed,
            "resume": False,
        },
    }
    SFTTrainer(parse_config(SFTConfig, sft, source="agent_calculator")).run()
    rl = {
        "preset": "grpo",
        "model": {"path": str(out / "sft" / "final"), "dtype": "float32"},
        "agent": {"env": ENV, "env_args": ENV_ARGS, "max_turns": 3, "max_total_tokens": 128, "log_trajectories": 4},
        "rollout": {"engine": args.engine, "dtype": "float32"},
        # A tool call ends at its closing tag; the template closes the turn itself.
        "sampling": {
            "n": args.samples_per_prompt,
            "max_new_tokens": 40,
            "temperature": 1.0,
            "stop": ["</calculator>"],
            "seed": args.seed,
        },
        "data": {"train": [str(prompts)], "eval": [str(held_out)], "seed": args.seed},
        "algorithm": {"kl_mode": "none", "kl_coef": 0.0},
        "optim": {"lr": args.rl_lr, "scheduler": "constant", "warmup_steps": min(5, args.rl_steps // 2)},
        "placement": {"threads_per_worker": min(4, os.cpu_count() or 1)},
        "train": {
            "output_dir": str(out / "rl"),
            "max_steps": args.rl_steps,
            "prompts_per_step": args.prompts_per_step,
            "micro_batch_tokens": 2048,
            "eval_threshold": 1.0,
            "seed": args.seed,
            "resume": False,
            "eval_every": args.eval_every,
        },
    }
    RLTrainer(parse_config(RLConfig, rl, source="agent_calculator")).run()
    evals = [r for r in read_metrics(out / "rl") if "eval/all/pass@1" in r]
    summary = {
        name: {"success": row["eval/all/pass@1"], "tool_use": row["eval/agent/tool_use_fraction"]}
        for name, row in (("before_rl", evals[0]), ("after_rl", evals[-1]))
    }
    summary["seconds"] = {"total": time.perf_counter() - start}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    before, after = summary["before_rl"], summary["after_rl"]
    log.info(
        "held-out questions (greedy): success %.0f%% -> %.0f%%, tool use %.0f%% -> %.0f%% (%s)",
        100 * before["success"],
        100 * after["success"],
        100 * before["tool_use"],
        100 * after["tool_use"],
        out / "summary.json",
    )
    return summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run(parse_args())
