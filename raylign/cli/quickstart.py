"""``raylign quickstart``: SFT warm-up, then GRPO, of a tiny model on a task with known answers, on the CPU.

Builds a small random Qwen2 model with a locally trained tokenizer and a synthetic
"reverse the letters" task, fine-tunes it briefly with ``raylign sft`` (to learn the answer
format), then runs GRPO with ``raylign rl`` and a verifiable reward (the fraction of answer
letters in the right place). Reports the held-out reward and exact-match rate before and
after RL, with a PNG plot of the reward curve.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import Field

from raylign.config.base import Section, parse_config

log = logging.getLogger("raylign")


class QuickstartConfig(Section):
    """raylign quickstart: SFT warm-up then GRPO of a tiny model reversing letters, on the CPU (a few minutes)."""

    output_dir: str = Field("outputs/quickstart", description="Where data, models, logs and plots go.")
    task: Literal["copy", "reverse"] = Field("reverse", description="The synthetic task.")
    sft_steps: int = Field(150, ge=0, description="SFT warm-up steps (teaches the answer format).")
    rl_steps: int = Field(40, ge=1, description="GRPO steps.")
    prompts_per_step: int = Field(32, ge=1, description="GRPO prompts per step.")
    samples_per_prompt: int = Field(8, ge=2, description="GRPO group size.")
    rl_lr: float = Field(1e-3, gt=0, description="GRPO learning rate (tiny models need a large one).")
    engine: Literal["hf", "vllm"] = Field("hf", description="Rollout engine; hf is fastest for a model this small.")
    seed: int = Field(0, description="Seed for data and model.")


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data(cfg: QuickstartConfig, out: Path) -> tuple[Path, Path, Path]:
    from raylign.tasks.strings import make_string_rows

    rows = make_string_rows(cfg.task, 2400, seed=cfg.seed, alphabet="abcdefgh", min_len=3, max_len=4)
    sft = write_jsonl(rows[:2000], out / "data" / "sft.jsonl")
    as_prompts = [{"prompt": r["prompt"], "label": r["completion"]} for r in rows[2000:]]
    train = write_jsonl(as_prompts[:300], out / "data" / "rl_prompts.jsonl")
    held_out = write_jsonl(as_prompts[300:], out / "data" / "eval_prompts.jsonl")
    return sft, train, held_out


def run_quickstart(cfg: QuickstartConfig) -> dict[str, float]:
    from raylign import tasks
    from raylign.config.commands import SFTConfig
    from raylign.config.rl import RLConfig
    from raylign.models.tiny import build_tiny_model
    from raylign.rl.trainer import RLTrainer
    from raylign.trainers.metrics import read_metrics
    from raylign.trainers.sft import SFTTrainer

    out = Path(cfg.output_dir)
    sft_file, prompts, held_out = _data(cfg, out)
    hidden, heads = (64, 4) if cfg.engine == "hf" else (128, 4)  # vLLM on CPU needs head size >= 32
    model = build_tiny_model(out / "base_model", hidden_size=hidden, num_heads=heads, num_kv_heads=2, seed=cfg.seed)
    if cfg.sft_steps:
        log.info("SFT warm-up: %d steps", cfg.sft_steps)
        sft = parse_config(SFTConfig, {
            "model": {"path": str(model), "dtype": "float32"},
            "data": {"train": [str(sft_file)], "max_length": 64, "min_response_tokens": 8, "seed": cfg.seed},
            "optim": {"lr": 3e-3, "warmup_steps": 5},
            "train": {"output_dir": str(out / "sft"), "max_steps": cfg.sft_steps, "global_batch_size": 32,
                      "micro_batch_size": 32, "seed": cfg.seed, "resume": False},
        }, source="quickstart")
        SFTTrainer(sft).run()
        model = out / "sft" / "final"
    log.info("GRPO: %d steps of %d prompts x %d samples", cfg.rl_steps, cfg.prompts_per_step, cfg.samples_per_prompt)
    rl = parse_config(RLConfig, {
        **RLConfig.preset_defaults({"preset": "grpo"}),
        "preset": "grpo",
        "model": {"path": str(model), "dtype": "float32"},
        "reward": {"sources": [{"kind": "function", "name": "letters", "function_name": "letter_match_reward",
                                "path": str(Path(tasks.__file__).parent / "strings.py")}]},
        "rollout": {"engine": cfg.engine, "dtype": "float32"},
        "sampling": {"n": cfg.samples_per_prompt, "max_new_tokens": 10, "temperature": 1.0},
        "data": {"train": [str(prompts)], "eval": [str(held_out)], "seed": cfg.seed},
        "optim": {"lr": cfg.rl_lr, "scheduler": "constant"},
        "train": {"output_dir": str(out / "rl"), "max_steps": cfg.rl_steps, "prompts_per_step": cfg.prompts_per_step,
                  "seed": cfg.seed, "resume": False, "eval_n": 4, "eval_temperature": 1.0},
    }, source="quickstart")
    RLTrainer(rl).run()

    evals = [r for r in read_metrics(out / "rl") if "eval/all/reward_mean" in r]
    before, after = evals[0], evals[-1]
    summary = {
        "reward_before": before["eval/all/reward_mean"], "reward_after": after["eval/all/reward_mean"],
        "exact_match_before": before["eval/all/pass@1"], "exact_match_after": after["eval/all/pass@1"],
        "pass@4_before": before["eval/all/pass@4"], "pass@4_after": after["eval/all/pass@4"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("held-out prompts (%s, 4 samples each at temperature 1): mean reward %.3f -> %.3f; "
             "exact answers %.1f%% -> %.1f%%; pass@4 %.1f%% -> %.1f%%", held_out.name,
             summary["reward_before"], summary["reward_after"], 100 * summary["exact_match_before"],
             100 * summary["exact_match_after"], 100 * summary["pass@4_before"], 100 * summary["pass@4_after"])
    log.info("results: policy %s | reward curve %s | metrics %s | TensorBoard %s",
             out / "rl" / "final", out / "rl" / "reward_curve.png", out / "rl" / "metrics.jsonl",
             out / "rl" / "tensorboard")
    return summary
