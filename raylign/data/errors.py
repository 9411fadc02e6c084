"""Errors of the data layer: every message names the file, and for a row also the row number and key."""

from __future__ import annotations

from dataclasses import dataclass


class DataError(ValueError):
    """A dataset that cannot be used: missing or corrupt file, unsupported format, bad template."""


class RowError(DataError):
    """One bad row. ``reason`` is a short category (``missing_key``, ``wrong_type``, ...) for skip counts."""

    def __init__(self, source: str, row: int, key: str | None, problem: str, reason: str):
        self.source, self.row, self.key, self.problem, self.reason = source, row, key, problem, reason
        place = f"{source}, row {row}" + (f", key '{key}'" if key is not None else "")
        super().__init__(f"{place}: {problem}")


class RowDropped(RowError):
    """A valid row left out by a policy (e.g. ``truncation='drop'``); always skipped and counted."""


@dataclass(frozen=True)
class RowRef:
    """Where a row came from, to put in errors and samples."""

    source: str
    row: int

    def __str__(self) -> str:
        return f"{self.source}, row {self.row}"

    def error(self, key: str | None, problem: str, reason: str) -> RowError:
        return RowError(self.source, self.row, key, problem, reason)

    def dropped(self, key: str | None, problem: str, reason: str) -> RowDropped:
        return RowDropped(self.source, self.row, key, problem, reason)
