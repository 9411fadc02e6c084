"""Metric sinks for every trainer: a JSON-lines file, TensorBoard, optionally wandb, and the console."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raylign.config.train import LoggingConfig
from raylign.errors import MissingPackageError

log = logging.getLogger("raylign")

# How long closing the metrics waits for wandb to finish its run (its uploads); wandb itself sets no
# limit, and without a network it can wait for ever, holding up the end of the run and its error.
WANDB_FINISH_TIMEOUT_S = 120.0


class MetricsLogger:
    """Writes one record per call to ``<output_dir>/metrics.jsonl`` and the configured sinks.

    Only the main process should create one; other ranks pass ``enabled=False``. A resumed run
    calls :meth:`resume_from` before it logs, and a run from step 0 :meth:`start_over`, so that each
    step appears once.
    """

    def __init__(self, output_dir: str | Path, cfg: LoggingConfig, run_config: dict[str, Any], enabled: bool = True):
        self.enabled = enabled
        self.cfg = cfg
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl_path = self.output_dir / "metrics.jsonl"
        self._jsonl = open(self._jsonl_path, "a", buffering=1)  # noqa: SIM115 - open for the logger's life
        self._purge_step: int | None = None  # TensorBoard hides the events from here on (a resume)
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise MissingPackageError(
                    "logging.wandb is on but wandb is not installed: pip install 'raylign[wandb]'"
                ) from None
            self._wandb = wandb.init(
                project=cfg.wandb_project, name=cfg.run_name or self.output_dir.name, config=run_config
            )

    def resume_from(self, step: int, evaluates_again: bool = False) -> int:
        """The run continues after the checkpoint of ``step``: records of later steps (written
        before the run stopped, and about to be written again) move from ``metrics.jsonl`` to
        ``metrics.superseded.jsonl``, and TensorBoard hides its events past ``step``. With
        ``evaluates_again`` (a run resumed at its last step evaluates that step again) the
        evaluation records of ``step`` move too. Returns how many records moved."""
        if not self.enabled:
            return 0
        self._jsonl.close()

        def later(line: str) -> bool:
            return _step_of(line) > step or (evaluates_again and _step_of(line) == step and _is_eval(line))

        moved = set_aside_lines(self._jsonl_path, later)
        self._jsonl = open(self._jsonl_path, "a", buffering=1)  # noqa: SIM115 - open for the logger's life
        self._purge_step = step + 1
        if self._tb is not None:  # reopened on the next record, with the purge step
            self._tb.close()
            self._tb = None
        if moved:
            what = "of an earlier run" if step < 0 else f"past step {step}, logged before the run stopped,"
            log.info(
                "metrics: %d record(s) %s moved to %s",
                moved,
                what,
                self.output_dir / "metrics.superseded.jsonl",
            )
        return moved

    def start_over(self) -> int:
        """The run starts at step 0 where another run logged (``train.resume: false``, or no
        checkpoint yet): all of that run's records move to ``metrics.superseded.jsonl`` and
        TensorBoard hides its events, so each step of this run is logged once. Returns how many moved."""
        return self.resume_from(-1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time(), 3), **{k: _to_float(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        if self.cfg.tensorboard and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=self._purge_step)
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "time"):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        """Flush and close every sink; closing twice does nothing."""
        if not self.enabled:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            finishing = threading.Thread(target=run.finish, name="wandb-finish", daemon=True)
            finishing.start()
            finishing.join(WANDB_FINISH_TIMEOUT_S)
            if finishing.is_alive():
                log.warning(
                    "wandb: the run did not finish its uploads within %g s; left unfinished (`wandb sync` "
                    "uploads its local folder later)",
                    WANDB_FINISH_TIMEOUT_S,
                )


def set_aside_lines(path: Path, superseded: Callable[[str], bool]) -> int:
    """Move the lines of the JSON-lines file ``path`` for which ``superseded`` holds to
    ``<name>.superseded.jsonl`` beside it (appended), so that nothing logged is lost; ``path`` is
    replaced atomically (a kill leaves one whole file or the other). Returns how many lines moved."""
    if not path.exists():
        return 0
    lines = [line if line.endswith("\n") else line + "\n" for line in path.read_text().splitlines() if line.strip()]
    kept: list[str] = []
    moved: list[str] = []
    for line in lines:
        (moved if superseded(line) else kept).append(line)
    if moved:
        with open(path.with_suffix(".superseded.jsonl"), "a") as aside:
            aside.writelines(moved)
        partial = path.with_suffix(".jsonl.partial")
        partial.write_text("".join(kept))
        partial.replace(path)
    return len(moved)


def _step_of(line: str) -> float:
    """The step of one ``metrics.jsonl`` line; a line cut short by a kill counts as past every step."""
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return math.inf


def _is_eval(line: str) -> bool:
    """Whether a ``metrics.jsonl`` line is an evaluation's record (its keys ``eval/...``)."""
    try:
        return any(key.startswith("eval/") for key in json.loads(line))
    except json.JSONDecodeError:
        return False


def _to_float(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def read_metrics(output_dir: str | Path) -> list[dict[str, float]]:
    """The records a run wrote, in order (for tests, plots and reports)."""
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_metrics(metrics: dict[str, float], keys: list[str] | None = None) -> str:
    keys = keys or list(metrics)
    return "  ".join(f"{k}={_short(metrics[k])}" for k in keys if k in metrics)


def _short(value: float) -> str:
    value = float(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"
