"""Shared by the fuzz tests: JSON-like value strategies, settings, and the count of cases tried per target.

Each fuzz test calls :func:`count_case` once per generated case with the name of what it
fuzzes; the counts are listed in the terminal summary (``tests/case_counts.py``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests import case_counts

# No example database, so a run never depends on earlier ones; too_slow would only flag a busy machine.
FUZZ = settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def count_case(target: str) -> None:
    case_counts.count("fuzz cases tried", target)


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
