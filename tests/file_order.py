"""Test files in order of their measured duration, longest first, so that the suite's two xdist workers
do not end with one of them running a long end-to-end file alone while the other idles.

``tests/durations.json`` holds each file's seconds (setup, call and teardown of all its tests, module
fixtures included) from one whole run; ``python -m pytest --write-durations tests/durations.json``
measures them again. A file it does not list counts as the median file. xdist then hands out files in
this order (``--no-loadscope-reorder``; by default it orders them by their number of tests).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        return {str(name): float(seconds) for name, seconds in data["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise pytest.UsageError(
            f'{path}: expected {{"files": {{"tests/...py": seconds, ...}}}} ({err}); '
            "rewrite it with python -m pytest --write-durations " + str(path)
        ) from err


def order_by_duration(items: list[pytest.Item], durations: dict[str, float]) -> None:
    """Sort ``items`` in place: files by duration, longest first (unknown files as the median one);
    within a file, and between files of equal duration, the collection order stays."""
    if not durations:
        return
    typical = statistics.median(durations.values())
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(file_of(item.nodeid), len(first_seen))

    def key(item: pytest.Item) -> tuple[float, int]:
        name = file_of(item.nodeid)
        return -durations.get(name, typical), first_seen[name]

    items.sort(key=key)  # stable: a file's tests keep their order


class DurationRecorder:
    """Adds up each file's test durations as reports arrive (under xdist, on the controller)."""

    def __init__(self, path: Path, machine: str):
        self.path, self.machine = path, machine
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if getattr(session.config, "workeroutput", None) is not None:
            return  # an xdist worker: the controller writes
        files = {name: round(seconds, 2) for name, seconds in sorted(self.seconds.items())}
        self.path.write_text(json.dumps({"machine": self.machine, "files": files}, indent=1) + "\n")
