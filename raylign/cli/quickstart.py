"""``raylign quickstart``: SFT of a tiny model on a task with known answers, on the CPU.

Builds a small random Qwen2 model with a locally trained tokenizer, writes a synthetic
"reverse the letters" data set, fine-tunes with the ordinary SFT trainer, and reports
held-out exact-match accuracy before and after, with a loss-curve plot.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import Field

from raylign.config.base import Section, parse_config
from raylign.config.commands import SFTConfig

log = logging.getLogger("raylign")


class QuickstartConfig(Section):
    """raylign quickstart: train a tiny model to reverse letter sequences on the CPU (a few minutes)."""

    output_dir: str = Field("outputs/quickstart", description="Where data, checkpoints, logs and the model go.")
    task: Literal["copy", "reverse"] = Field("reverse", description="The synthetic task.")
    train_rows: int = Field(4000, ge=64, description="Synthetic training examples.")
    eval_rows: int = Field(200, ge=8, description="Held-out examples (never seen in training) for accuracy.")
    steps: int = Field(250, ge=1, description="Optimizer steps.")
    batch_size: int = Field(64, ge=1, description="Samples per optimizer step.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    hidden_size: int = Field(128, ge=16, description="Width of the tiny model.")
    num_layers: int = Field(2, ge=1, description="Decoder layers of the tiny model.")
    seed: int = Field(0, description="Seed for data and model.")


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_quickstart(cfg: QuickstartConfig) -> dict[str, float]:
    from raylign.models.tiny import build_tiny_model
    from raylign.tasks.evaluate import greedy_chat_answers
    from raylign.tasks.strings import exact_match, make_string_rows
    from raylign.trainers.plots import plot_metric
    from raylign.trainers.sft import SFTTrainer

    out = Path(cfg.output_dir)
    eval_rows = make_string_rows(cfg.task, cfg.eval_rows, seed=cfg.seed + 1)
    train_rows = make_string_rows(cfg.task, cfg.train_rows, seed=cfg.seed, exclude={r["prompt"] for r in eval_rows})
    train_file = write_jsonl(train_rows, out / "data" / "train.jsonl")
    eval_file = write_jsonl(eval_rows, out / "data" / "eval.jsonl")
    base = build_tiny_model(out / "base_model", hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, seed=cfg.seed)

    def accuracy(model_dir: Path) -> float:
        replies = greedy_chat_answers(model_dir, [r["prompt"] for r in eval_rows], max_new_tokens=16)
        return sum(exact_match(p, r["completion"]) for p, r in zip(replies, eval_rows)) / len(eval_rows)

    before = accuracy(base)
    sft_cfg = parse_config(SFTConfig, {
        "model": {"path": str(base), "dtype": "float32"},
        "data": {"train": [{"path": str(train_file)}], "eval": [{"path": str(eval_file)}], "format": "chat",
                 "max_length": 128, "packing": True},
        "optim": {"lr": cfg.lr, "warmup_steps": max(1, cfg.steps // 20), "scheduler": "cosine",
                  "min_lr_ratio": 0.1, "weight_decay": 0.0},
        "train": {"output_dir": str(out / "sft"), "max_steps": cfg.steps, "global_batch_size": cfg.batch_size,
                  "micro_batch_size": cfg.batch_size, "eval_every": max(1, cfg.steps // 5),
                  "save_every": 0, "seed": cfg.seed, "resume": False},
    }, source="quickstart")
    SFTTrainer(sft_cfg).run()
    final = out / "sft" / "final"
    after = accuracy(final)
    plot = plot_metric(out / "sft", "train/loss", out / "loss_curve.png", title=f"SFT loss ({cfg.task})")
    summary = {"accuracy_before": before, "accuracy_after": after}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("held-out exact match (%d prompts): before %.1f%% -> after %.1f%%",
             len(eval_rows), 100 * before, 100 * after)
    log.info("trained model: %s | metrics: %s | TensorBoard: %s | loss curve: %s",
             final, out / "sft" / "metrics.jsonl", out / "sft" / "tensorboard", plot)
    return summary
