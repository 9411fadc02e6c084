"""Shared by the fuzz tests: JSON-like value strategies, settings, and the count of cases tried per target.

Each fuzz test calls :func:`count_case` once per generated case with the name of what it
fuzzes; the counts are listed in the terminal summary (also under ``-q``) once a fuzz module
has called :func:`register_case_summary`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

CASES: Counter[str] = Counter()

# No example database, so a run never depends on earlier ones; too_slow would only flag a busy machine.
FUZZ = settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def count_case(target: str) -> None:
    CASES[target] += 1


class _CaseSummary:
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not CASES:
            return
        terminalreporter.write_sep("-", "fuzz cases tried")
        for target, cases in sorted(CASES.items()):
            terminalreporter.write_line(f"{cases:6d}  {target}")
        terminalreporter.write_line(f"{sum(CASES.values()):6d}  in total, {len(CASES)} targets")


def register_case_summary(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("fuzz-case-summary"):
        config.pluginmanager.register(_CaseSummary(), "fuzz-case-summary")


# ---------------------------------------------------------------- strategies

# Integers beyond the float range and past Python's int-to-text digit limit are valid JSON numbers.
HUGE_INTEGERS = st.sampled_from([10**400, -(10**400), 2**1024])
NUMBERS = (
    st.integers()
    # no subnormals: the test session flushes them to zero (tests/conftest.py)
    | st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False)
    | HUGE_INTEGERS
)
# Odd text: control and format characters, lone surrogates (valid in JSON as \udXXX escapes),
# right-to-left marks, whitespace only, and the tiny tokenizer's special tokens.
ODD_TEXT = st.one_of(
    st.text(max_size=20),
    st.text(st.characters(categories=["Cc", "Cf", "Zs", "Zl", "Zp", "Cs", "Co"]), min_size=1, max_size=8),
    st.sampled_from(["", " ", "\n\t", "\u200b", "\u202e", "<|im_end|>", "<|im_start|>", "{input}", "{% generation %}"]),
)
TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30) | ODD_TEXT
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8,
)
