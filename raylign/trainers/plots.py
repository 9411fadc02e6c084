"""PNG plots of logged metrics (a curve says more than a table)."""

from __future__ import annotations

from pathlib import Path

from raylign.trainers.metrics import read_metrics


def plot_metric(run_dir: str | Path, key: str, out_png: str | Path, title: str | None = None) -> Path:
    """Plot ``key`` against step from ``<run_dir>/metrics.jsonl`` into ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["step"], r[key]) for r in read_metrics(run_dir) if key in r]
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
