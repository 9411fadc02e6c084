"""Console progress for long loops: a rich bar on a terminal, plain log lines in files and job logs.

When stderr is a terminal the progress is a rich bar, redrawn in place. When it is not (a
batch job, ``raylign sft ... 2>&1 | tee run.log``), a redrawn bar only leaves a truncated
``sft ━━━━━ 150/… 0:00…`` in the log, so instead one plain line goes to the ``raylign``
logger every ``max(1, total // 20)`` steps (about 20 lines a run), on the first and the last
step, and at ``close()`` for the last position if it has no line yet::

    sft 150/300 (50%) elapsed 0:01:23 eta 0:01:23 | loss=1.23  lr=0.0015

The environment variable ``RAYLIGN_PROGRESS`` overrides the choice: ``bar`` (always the rich
bar), ``lines`` (always plain lines), ``off`` (nothing); unset, empty or ``auto`` chooses by
whether stderr is a terminal. ``enabled=False`` is silent whatever the variable says; callers
pass it on non-main ranks and when the config turns the progress bar off.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

log = logging.getLogger("raylign")

MODES = ("bar", "lines", "off")
LINES_PER_RUN = 20


def progress_mode() -> str:
    """``bar``, ``lines`` or ``off``: ``RAYLIGN_PROGRESS`` if set, else ``bar`` exactly when stderr is a terminal."""
    mode = os.environ.get("RAYLIGN_PROGRESS", "").strip().lower()
    if mode in ("", "auto"):
        return "bar" if _is_terminal(sys.stderr) else "lines"
    if mode not in MODES:
        raise ValueError(f"RAYLIGN_PROGRESS={mode!r}: expected one of auto, {', '.join(MODES)}")
    return mode


def _is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except ValueError:  # a closed stream
        return False


def format_duration(seconds: float) -> str:
    """``H:MM:SS``, as rich prints elapsed and remaining time."""
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    """Progress of ``total`` steps named ``description``: a rich bar on a terminal, plain lines otherwise.

    ``advance_to(completed, info)`` reports the position (``info``, e.g. the latest metrics, is
    shown after it); ``close()`` ends the display. Without a terminal on stderr a line goes to the
    ``raylign`` logger on the first reported position, each time the position reaches or passes
    a multiple of ``max(1, total // 20)``, on ``total``, and at ``close()`` for the last position if
    it has none. The remaining time is measured from the first reported position (unknown, ``?``,
    until a second one arrives). ``RAYLIGN_PROGRESS=bar|lines|off`` forces a mode;
    ``enabled=False`` (non-main ranks, ``progress_bar: false``) shows nothing. ``clock`` gives
    seconds (monotonic; tests pass their own).
    """

    def __init__(
        self, total: int, description: str, enabled: bool = True, *, clock: Callable[[], float] = time.monotonic
    ):
        self.total = total
        self.description = description
        self.mode = progress_mode() if enabled else "off"
        self._bar: RichProgress | None = None
        self._clock = clock
        self._start_time = clock()
        self._every = max(1, total // LINES_PER_RUN)
        self._first: tuple[int, float] | None = None  # the first reported (position, time): the eta's origin
        self._position = 0
        self._info = ""
        self._logged: int | None = None  # the position of the last line
        if self.mode == "bar":
            self._start_bar()

    def _start_bar(self) -> None:
        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            transient=False,
        )
        self._task = self._bar.add_task(self.description, total=self.total, info="")
        self._bar.start()

    def advance_to(self, completed: int, info: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, info=info)
        if self.mode != "lines":
            return
        now = self._clock()
        if self._first is None:
            self._first = (completed, now)
        self._position, self._info = completed, info
        if completed > 0 and (self._logged is None or self._passes_mark(completed) or completed == self.total):
            self._log_line(now)

    def _passes_mark(self, completed: int) -> bool:
        return completed // self._every > self._logged // self._every

    def _log_line(self, now: float) -> None:
        if self._logged == self._position:
            return
        self._logged = self._position
        log.info("%s", self._format_line(now))

    def _format_line(self, now: float) -> str:
        """``sft 150/300 (50%) elapsed 0:01:23 eta 0:01:23 | <info>`` for the current position."""
        done, total = self._position, self.total
        percent = 100 if total <= 0 else 100 * done // total
        eta = "?"
        first_done, first_time = self._first if self._first is not None else (done, now)
        if done > first_done:
            seconds_per_step = (now - first_time) / (done - first_done)
            eta = format_duration(max(0, total - done) * seconds_per_step)
        line = (
            f"{self.description} {done}/{total} ({percent}%) "
            f"elapsed {format_duration(now - self._start_time)} eta {eta}"
        )
        return f"{line} | {self._info}" if self._info else line

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self.mode == "lines" and self._position > 0:
            self._log_line(self._clock())
        self.mode = "off"
