"""A console progress bar for long loops (rich), silent on non-main ranks and when disabled."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, total: int, description: str, enabled: bool = True):
        self._bar = None
        if not enabled:
            return
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
        self._task = self._bar.add_task(description, total=total, info="")
        self._bar.start()

    def advance_to(self, completed: int, info: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
