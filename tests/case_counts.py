"""Cases generated per property or fuzz target, listed in the terminal summary (also under ``-q``).

The property tests (``tests/algorithms/test_properties.py``) and the fuzz tests
(``tests/fuzz_cases.py``) call :func:`count` once per generated case. Under pytest-xdist each
worker counts its own cases; ``tests/conftest.py`` hands them to the controller, which adds them
up and lists them once.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

# summary title -> what a target is called in the total line
TITLES = {"hypothesis cases tried": "properties", "fuzz cases tried": "targets"}
COUNTS: dict[str, Counter[str]] = {title: Counter() for title in TITLES}


def count(title: str, target: str) -> None:
    COUNTS[title][target] += 1


def as_dict() -> dict[str, dict[str, int]]:
    return {title: dict(cases) for title, cases in COUNTS.items() if cases}


def add(counts: dict[str, dict[str, int]]) -> None:
    """Add a worker's counts (:func:`as_dict`) to this process's."""
    for title, cases in counts.items():
        COUNTS[title].update(cases)


def write_summary(terminalreporter: Any) -> None:
    for title, noun in TITLES.items():
        cases = COUNTS[title]
        if not cases:
            continue
        terminalreporter.write_sep("-", title)
        for target, n in sorted(cases.items()):
            terminalreporter.write_line(f"{n:6d}  {target}")
        terminalreporter.write_line(f"{sum(cases.values()):6d}  in total, {len(cases)} {noun}")
