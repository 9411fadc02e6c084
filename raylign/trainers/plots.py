"""PNG plots of logged metrics (a curve says more than a table).

:func:`plot_metric` draws one key of a run. The ``plot_*`` figures after it are the ones in the
documentation, drawn by ``scripts/docs_plots.py`` from runs of the quickstart, the SmolLM2 math
example and ``benchmarks/async_rl.py``; each returns the values it drew, so that a test can check
them against the records.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

from raylign.trainers.metrics import read_metrics

Points = list[tuple[float, float]]  # (step, value), by step

# Instruction sets that decide how fast a CPU trains: native bf16 (AMX, AVX512-BF16), then the vector width.
ISA_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
DOCS_DPI = 100  # the documentation's figures stay small in the repository


def plot_metric(run_dir: str | Path, key: str, out_png: str | Path, title: str | None = None) -> Path:
    """Plot ``key`` against step from ``<run_dir>/metrics.jsonl`` into ``out_png``."""
    plt = _pyplot()
    points = metric_points(read_metrics(run_dir), key)
    if not points:
        raise ValueError(f"no '{key}' values in {Path(run_dir) / 'metrics.jsonl'}")
    steps, values = zip(*points)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, values, marker="." if len(steps) < 60 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title or key)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def metric_points(records: Iterable[dict[str, float]], key: str) -> Points:
    """(step, value) of every record that has ``key``, by step (an asynchronous run logs an
    evaluation under the step it started at, after records of later steps)."""
    return sorted(((record["step"], record[key]) for record in records if key in record), key=lambda p: p[0])


def eval_sources(records: Iterable[dict[str, float]]) -> list[str]:
    """The data sources an RL run evaluated (``eval/<source>/pass@1``, not ``all``), in the order first logged."""
    sources: dict[str, None] = {}
    for record in records:
        for key in record:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval" and parts[2] == "pass@1" and parts[1] != "all":
                sources[parts[1]] = None
    return list(sources)


def machine_caption(day: date) -> str:
    """The CPU model, its core count, the instruction sets of :data:`ISA_FLAGS` it has, a GPU if
    torch sees one, and ``day``: the line under each figure of the documentation."""
    import torch

    from raylign.hardware import cpu_flags, cpu_model

    isa = [flag for flag in ISA_FLAGS if flag in cpu_flags()] or ["no AVX2"]
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{cpu_model()}, {os.cpu_count()} cores ({', '.join(isa)}){gpu}, {day.isoformat()}"


def plot_quickstart_reward(records: Sequence[dict[str, float]], out_png: str | Path, caption: str) -> dict[str, Points]:
    """The quickstart's GRPO run: the mean reward of each step's samples (temperature 1), and at the
    steps it evaluated, the held-out prompts' greedy mean reward and fraction of exact answers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.9))
    drawn = {
        "reward/mean": _draw(ax, records, "reward/mean", "training samples: mean reward"),
        "eval/all/reward_mean": _draw(ax, records, "eval/all/reward_mean", "held-out, greedy: mean reward"),
        "eval/all/pass@1": _draw(ax, records, "eval/all/pass@1", "held-out, greedy: exact answers"),
    }
    ax.set(xlabel="GRPO step", ylabel="reward, fraction exact", ylim=(-0.03, 1.03))
    ax.set_title("raylign quickstart: reward per step", fontsize=11)
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, out_png, caption)
    return drawn


def plot_math_example(records: Sequence[dict[str, float]], out_png: str | Path, caption: str) -> dict[str, Points]:
    """The SmolLM2 math example: the mean training reward per step, greedy pass@1 of every eval
    source at the steps it evaluated, and the mean response length per step."""
    sources = eval_sources(records)
    if not sources:
        raise ValueError("no eval/<source>/pass@1 in the records: the run evaluated nothing")
    plt = _pyplot()
    fig, (reward_ax, eval_ax, length_ax) = plt.subplots(1, 3, figsize=(11, 3.6))
    drawn = {"reward/mean": _draw(reward_ax, records, "reward/mean", "mean of the step's samples")}
    for source in sources:
        drawn[f"eval/{source}/pass@1"] = _draw(eval_ax, records, f"eval/{source}/pass@1", source)
    drawn["response_length/mean"] = _draw(length_ax, records, "response_length/mean", "mean of the step's samples")
    reward_ax.set(xlabel="step", ylabel="reward", title="training reward")
    eval_ax.set(xlabel="step", ylabel="pass@1 (greedy)", title="held-out eval", ylim=(-0.02, None))
    length_ax.set(xlabel="step", ylabel="tokens", title="response length")
    for ax in (reward_ax, eval_ax, length_ax):
        ax.legend(fontsize=8)
    fig.suptitle("GRPO on SmolLM2-135M-Instruct, examples/rl_grpo_smollm2_math.yaml", fontsize=11)
    _save(fig, out_png, caption)
    return drawn


# A step's time follows how long the answers run, which differs between settings' runs: the length is drawn beside it.
ASYNC_BARS = (
    ("step_s", "seconds per step (median)", "{:.2f}"),
    ("tokens_per_s", "generated tokens/s", "{:.0f}"),
    ("len_mean", "mean response length (tokens)", "{:.1f}"),
)


def plot_async_throughput(
    rows: Sequence[dict[str, Any]], out_png: str | Path, caption: str, title: str
) -> dict[str, dict[str, float]]:
    """``benchmarks/async_rl.py``'s result rows, one bar per setting: the median seconds of a step,
    the generated tokens per second of wall time and the mean response length. Returns
    ``{"step_s": {setting: value}, "tokens_per_s": ..., "len_mean": ...}``."""
    if not rows:
        raise ValueError("no result rows to plot")
    plt = _pyplot()
    settings = [row["setting"] for row in rows]
    drawn = {key: {row["setting"]: float(row[key]) for row in rows} for key, _, _ in ASYNC_BARS}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    colors = ["0.55" if setting == "sync" else "tab:blue" for setting in settings]
    for ax, (key, label, fmt) in zip(axes, ASYNC_BARS):
        values = [drawn[key][setting] for setting in settings]
        bars = ax.bar(settings, values, color=colors)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=7)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=11)
    _save(fig, out_png, caption)
    return drawn


def _draw(ax: Any, records: Sequence[dict[str, float]], key: str, label: str) -> Points:
    points = metric_points(records, key)
    if not points:
        raise ValueError(f"no '{key}' in the records")
    steps, values = zip(*points)
    ax.plot(steps, values, label=label, marker="o" if len(points) <= 20 else None, markersize=4)
    ax.grid(alpha=0.3)
    return points


def _save(fig: Any, out_png: str | Path, caption: str) -> Path:
    """Writes ``caption`` (one or more lines) under the plots, then the PNG."""
    import matplotlib.pyplot as plt

    fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=7, color="0.3")
    caption_height = (caption.count("\n") + 1) * 9 + 8  # points: 7-point lines and a margin
    fig.tight_layout(rect=(0, caption_height / (72 * fig.get_figheight()), 1, 1))
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=DOCS_DPI)
    plt.close(fig)
    return out_png


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
