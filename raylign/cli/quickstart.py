"""``raylign quickstart``: a short SFT warm-up, then GRPO, of a tiny model on a task with known answers, on the CPU.

Builds a small random Qwen2 model with a locally trained tokenizer and a synthetic letter
task, fine-tunes it briefly with ``raylign sft`` (stopped early on purpose: the model learns
the answer format, not yet the answers), then runs GRPO with ``raylign rl`` and a verifiable
reward (the fraction of answer letters in the right place). The same held-out prompts are
scored greedily three times: by the random model, after the warm-up and after RL, so the
summary shows what each phase added. Writes ``summary.json`` and a plot of the reward curve.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from raylign.cli.tiny_model import check_attention_shape
from raylign.config.base import Section, parse_config

log = logging.getLogger("raylign")

NUM_HEADS, NUM_KV_HEADS = 4, 2  # of the tiny model


class QuickstartConfig(Section):
    """raylign quickstart: SFT warm-up then GRPO of a tiny model on a letter task, on the CPU (a few minutes)."""

    output_dir: str = Field("outputs/quickstart", description="Where data, models, logs and plots go.")
    task: Literal["copy", "reverse"] = Field(
        "copy",
        description="The synthetic task: repeat or reverse 3-4 letters (reverse takes a few times more RL steps).",
    )
    sft_steps: int = Field(25, ge=0, description="SFT warm-up steps (stopped early: teaches the answer format).")
    rl_steps: int = Field(80, ge=1, description="GRPO steps.")
    ppo_epochs: int = Field(2, ge=1, description="Passes over each step's samples (the second one clipped).")
    prompts_per_step: int = Field(32, ge=1, description="GRPO prompts per step.")
    samples_per_prompt: int = Field(8, ge=2, description="GRPO group size.")
    rl_lr: float = Field(1e-3, gt=0, description="GRPO learning rate (tiny models need a large one).")
    hidden_size: int = Field(
        128, ge=32, description="Width of the tiny model (2 layers, 4 heads): a multiple of 8 (an even head size)."
    )
    engine: Literal["hf", "vllm"] = Field("hf", description="Rollout engine; hf is fastest for a model this small.")
    seed: int = Field(0, description="Seed for data and model.")

    @model_validator(mode="after")
    def _attention_shape(self) -> QuickstartConfig:
        check_attention_shape(self.hidden_size, NUM_HEADS, NUM_KV_HEADS)
        return self


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data(cfg: QuickstartConfig, out: Path) -> tuple[Path, Path, Path]:
    from raylign.tasks.strings import make_string_rows

    rows = make_string_rows(cfg.task, 2400, seed=cfg.seed, alphabet="abcdefgh", min_len=3, max_len=4)
    # A leading space makes every answer letter the same token as in the prompt (" g", not "g" first).
    rows = [{"prompt": r["prompt"], "completion": " " + r["completion"]} for r in rows]
    sft = write_jsonl(rows[:2000], out / "data" / "sft.jsonl")
    as_prompts = [{"prompt": r["prompt"], "label": r["completion"]} for r in rows[2000:]]
    train = write_jsonl(as_prompts[:300], out / "data" / "rl_prompts.jsonl")
    held_out = write_jsonl(as_prompts[300:], out / "data" / "eval_prompts.jsonl")
    return sft, train, held_out


def greedy_eval(model_dir: Path, prompt_file: Path, max_new_tokens: int) -> dict[str, float]:
    """Mean reward and exact-answer rate of greedy answers to ``prompt_file``, generated in this process
    with the ``hf`` engine from the same prompts and reward as the RL run's own eval."""
    from raylign.config.rl import RLDataConfig
    from raylign.config.rollout import RolloutConfig, SamplingConfig
    from raylign.models import load_tokenizer
    from raylign.rl.prompts import load_prompts
    from raylign.rollout.hf_engine import HFEngine
    from raylign.tasks.strings import exact_match, letter_match_reward

    tokenizer = load_tokenizer(str(model_dir), padding_side="left")
    data = RLDataConfig(train=[str(prompt_file)])
    prompts = load_prompts(data.train, data, tokenizer)
    engine = HFEngine(str(model_dir), RolloutConfig(engine="hf", dtype="float32"))
    sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    completions = asyncio.run(engine.generate([p.token_ids for p in prompts], sampling))
    responses = [c.text for c in sorted(completions, key=lambda c: c.prompt_index)]
    labels = [p.label for p in prompts]
    rewards = letter_match_reward([p.text for p in prompts], responses, labels)
    exact = [exact_match(r, str(label)) for r, label in zip(responses, labels)]
    return {"reward": sum(rewards) / len(rewards), "exact_match": sum(exact) / len(exact)}


def run_quickstart(cfg: QuickstartConfig) -> dict[str, dict[str, float]]:
    from raylign import tasks
    from raylign.config.commands import SFTConfig
    from raylign.config.rl import RLConfig
    from raylign.models.tiny import build_tiny_model
    from raylign.rl.trainer import RLTrainer
    from raylign.trainers.metrics import read_metrics
    from raylign.trainers.sft import SFTTrainer

    start = time.perf_counter()
    out = Path(cfg.output_dir)
    sft_file, prompts, held_out = _data(cfg, out)
    max_new_tokens = 10
    # The default hidden_size gives a head size of 32, one vLLM's CPU attention runs. Untied embeddings:
    # with tied ones, the RL gradient that lowers a letter's output logit also blurs that letter in the
    # prompt, and a run can lose a letter.
    model = build_tiny_model(
        out / "base_model",
        hidden_size=cfg.hidden_size,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        tie_word_embeddings=False,
        seed=cfg.seed,
    )
    summary: dict[str, dict[str, float]] = {"base_model": greedy_eval(model, held_out, max_new_tokens)}
    if cfg.sft_steps:
        log.info("SFT warm-up: %d steps", cfg.sft_steps)
        sft = parse_config(
            SFTConfig,
            {
                "model": {"path": str(model), "dtype": "float32"},
                "data": {"train": [str(sft_file)], "max_length": 64, "seed": cfg.seed},
                "optim": {"lr": 3e-3, "warmup_steps": min(5, cfg.sft_steps)},  # no longer than the run
                "train": {
                    "output_dir": str(out / "sft"),
                    "max_steps": cfg.sft_steps,
                    "global_batch_size": 32,
                    "micro_batch_size": 32,
                    "seed": cfg.seed,
                    "resume": False,
                },
            },
            source="quickstart",
        )
        SFTTrainer(sft).run()
        model = out / "sft" / "final"
    log.info("GRPO: %d steps of %d prompts x %d samples", cfg.rl_steps, cfg.prompts_per_step, cfg.samples_per_prompt)
    rl = parse_config(
        RLConfig,
        {
            "preset": "grpo",
            # The k3 KL term to the warm-up model at the GRPO paper's 0.04, not the preset's 0.001: with a
            # learning rate this large, how often each letter is produced swings from step to step, and a
            # letter that drops out is never sampled again, so no group rewards it back. The KL term pulls
            # the policy back toward the warm-up model, which still produces every letter.
            "algorithm": {"kl_coef": 0.04},
            # float32 on every CPU: a model this small gains nothing from bf16 and learns less exactly in it.
            "model": {"path": str(model), "dtype": "float32"},
            "reward": {
                "sources": [
                    {
                        "kind": "function",
                        "name": "letters",
                        "function_name": "letter_match_reward",
                        "path": str(Path(tasks.__file__).parent / "strings.py"),
                    }
                ]
            },
            "rollout": {"engine": cfg.engine, "dtype": "float32"},
            "sampling": {"n": cfg.samples_per_prompt, "max_new_tokens": max_new_tokens, "temperature": 1.0},
            "data": {"train": [str(prompts)], "eval": [str(held_out)], "seed": cfg.seed},
            # A short warm-up of the learning rate: Adam's first steps move every weight by about lr at once.
            # At most one warm-up step per RL step, so that a shorter run still starts.
            "optim": {"lr": cfg.rl_lr, "scheduler": "constant", "warmup_steps": min(10, cfg.rl_steps)},
            # The phases take turns, so each worker computes on every core, but on at most 4: a model this
            # small has too little work per matrix product to keep more threads busy.
            "placement": {"threads_per_worker": min(4, os.cpu_count() or 1)},
            "train": {
                "output_dir": str(out / "rl"),
                "max_steps": cfg.rl_steps,
                "prompts_per_step": cfg.prompts_per_step,
                "ppo_epochs": cfg.ppo_epochs,
                "seed": cfg.seed,
                "resume": False,
                "eval_every": max(1, cfg.rl_steps // 4),
            },
        },
        source="quickstart",
    )
    RLTrainer(rl).run()

    evals = [r for r in read_metrics(out / "rl") if "eval/all/reward_mean" in r]
    for name, row in (("after_warmup", evals[0]), ("after_rl", evals[-1])):
        summary[name] = {"reward": row["eval/all/reward_mean"], "exact_match": row["eval/all/pass@1"]}
    summary["seconds"] = {"total": time.perf_counter() - start}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _report(summary, held_out, out, warmed_up=cfg.sft_steps > 0)
    return summary


def _report(summary: dict[str, dict[str, float]], held_out: Path, out: Path, warmed_up: bool) -> None:
    base, warm, final = summary["base_model"], summary["after_warmup"], summary["after_rl"]
    log.info("held-out prompts (%s, greedy answers): mean reward / exact answers", held_out)
    start = "after the SFT warm-up" if warmed_up else "before GRPO (no SFT)"
    for label, row in (("random model", base), (start, warm), ("after GRPO", final)):
        log.info("  %-22s %.3f / %5.1f%%", label, row["reward"], 100 * row["exact_match"])
    moved = "raised" if final["reward"] > warm["reward"] else "did not raise"
    log.info(
        "RL %s the held-out mean reward (%.3f to %.3f; exact answers %.0f%% to %.0f%%)%s",
        moved,
        warm["reward"],
        final["reward"],
        100 * warm["exact_match"],
        100 * final["exact_match"],
        f"; the warm-up alone had brought it from {base['reward']:.3f} to {warm['reward']:.3f}." if warmed_up else ".",
    )
    log.info(
        "results: policy %s | reward curve %s | metrics %s | TensorBoard %s | summary %s",
        out / "rl" / "final",
        out / "rl" / "reward_curve.png",
        out / "rl" / "metrics.jsonl",
        out / "rl" / "tensorboard",
        out / "summary.json",
    )
