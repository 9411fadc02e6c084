"""What a trainer does when a step's loss or gradient norm is not finite.

The engine drops such an update (see :meth:`raylign.engine.base.TrainEngine.step`), so the weights
stay as they were; the trainer counts the skipped step and goes on, unless
``train.max_skipped_steps`` steps in a row have been skipped: then the run stops with what was
not finite, and where. A loss that blows up once (one bad batch) costs one step; one that
stays non-finite stops the run before it burns hours.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("raylign")


class SkippedSteps:
    """Counts steps skipped for non-finite values; raises once more than ``limit`` come in a row."""

    def __init__(self, limit: int, setting: str = "train.max_skipped_steps"):
        self.limit, self.setting = limit, setting
        self.in_a_row = 0
        self.total = 0

    def after_step(self, step: int, skipped: bool, what: str) -> None:
        """``step`` (1-based) was skipped or not; ``what`` says what was not finite, and where."""
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row > self.limit:
            raise FloatingPointError(
                f"step {step}: {what}; the update was skipped, {self.in_a_row} step(s) in a row (more than "
                f"{self.setting} = {self.limit}). Lower optim.lr, check the data of these steps, or raise "
                f"{self.setting}; the newest checkpoint holds weights from before the first skipped step"
            )
        log.warning(
            "step %d skipped: %s (%d in a row, %d in all; the run stops after %d in a row)",
            step,
            what,
            self.in_a_row,
            self.total,
            self.limit + 1,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])
