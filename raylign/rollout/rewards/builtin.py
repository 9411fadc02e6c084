"""Verifiable rewards that need no model: math answers, exact match, and a format regex.

Each gives 1.0 or 0.0 per sample. A label that cannot be read (a math label math-verify cannot
parse, a missing or blank label, a float where text is compared, a boolean, list or mapping) is an
error naming the sample: it is a data problem, not a wrong answer. A
float NaN label is missing too (how pandas and parquet files write an empty cell); read as text it
would be the symbol ``nan``, which a response saying "nan" would match.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

from raylign.rollout.rewards.base import RewardError, RewardResult, RewardSource, describe_sample

# "\boxed{" or "\fbox{"; LaTeX allows spaces before the brace ("\boxed {5}").
_BOXED_OPENER = re.compile(r"\\(?:boxed|fbox)\s*\{")


def label_is_missing(label: Any) -> bool:
    """None, or a float NaN (an empty cell of a pandas-written or parquet file)."""
    return label is None or (isinstance(label, float) and math.isnan(label))


def label_text(label: Any, numbers: bool) -> str:
    """A present label (see ``label_is_missing``) as the text a verifier compares with; ValueError for
    one it cannot stand for.

    Text and integers are taken, blank text is refused (an empty CSV cell). A float is taken where the
    verifier compares ``numbers``; where it compares text, 3.0 would never equal "3", and a column of
    integers with an empty cell is read back as floats, so it is refused. Booleans, lists and mappings
    are refused: their text ('True', "['A', 'B']") is no answer a response would give.
    """
    if isinstance(label, str) and not label.strip():
        raise ValueError(f"the label {label!r} is blank (an empty cell?)")
    if isinstance(label, str) or (isinstance(label, int) and not isinstance(label, bool)):
        return str(label)
    if isinstance(label, float):
        if numbers and math.isfinite(label):
            return repr(label)
        if not numbers:
            raise ValueError(
                f"the label is the number {label!r}, and this reward compares text: write labels as strings "
                "(a column of integers with an empty cell is read back as floats)"
            )
    raise ValueError(f"the label {label!r:.80} is a {type(label).__name__}, not an answer; write it as text")


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if none."""
    openers = list(_BOXED_OPENER.finditer(text))
    if not openers:
        return None
    start = openers[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None  # unclosed: the response was cut off inside the box


def extract_math_answer(response: str) -> str | None:
    """What a response's final answer is read from: its last ``\\boxed{}``; the whole response when it
    has no box (math-verify then takes its last expression, LaTeX or plain: '$\\frac{1}{2}$' is 1/2,
    '1,000' is 1000); None when the last box is left open (the response was cut off inside it)."""
    if not _BOXED_OPENER.search(response):
        return response
    boxed = last_boxed_content(response)
    if boxed is None or not boxed.strip():
        return None
    return "\\boxed{" + boxed + "}"


def _math_verify_timeouts() -> dict[str, int | None]:
    # math-verify bounds sympy's work with SIGALRM, which Python allows only in the main thread;
    # elsewhere (server threads, actor threads) its parse would fail and quietly return nothing.
    on_main = threading.current_thread() is threading.main_thread()
    return {"parsing_timeout": 5 if on_main else None, "timeout_seconds": 5 if on_main else None}


# A "$" that delimits math; "\$" is LaTeX for the dollar sign itself (MATH writes money answers as "\$18.90").
_MATH_DELIMITER = re.compile(r"(?<!\\)\$")


def _has_expression(parsed: list) -> bool:
    """Whether math-verify's parse holds an expression, not only its raw-text fallback."""
    return any(not isinstance(item, str) for item in parsed)


def _parse_math(text: str, label: bool = False) -> list:
    """math-verify's parse of ``text``. A ``label`` written bare (no ``$`` delimiters, no box) is read as
    the content of a ``\\boxed{}``, the way a response's answer is, so '2\\sqrt{3}' is 2*sqrt(3) and '1,2'
    the pair {1, 2}; the plain-text parse would take their leading numbers (2, 1.2). Plain text only
    where LaTeX finds no expression."""
    from math_verify import parse

    timeout = _math_verify_timeouts()["parsing_timeout"]
    if label and not _MATH_DELIMITER.search(text) and not _BOXED_OPENER.search(text):
        parsed = parse("\\boxed{" + text + "}", parsing_timeout=timeout)
        if _has_expression(parsed):
            return parsed
    return parse(text, parsing_timeout=timeout)


def math_answer_is_correct(response: str, label: Any) -> tuple[bool, bool]:
    """(answer found, answer equals label) by math-verify; ValueError when the label cannot be parsed."""
    from math_verify import verify

    text = label_text(label, numbers=True)
    gold = _parse_math(text, label=True)
    if not _has_expression(gold):
        raise ValueError(f"math-verify cannot parse the label {text!r:.80}")
    answer = extract_math_answer(response)
    if answer is None:
        return False, False
    target = _parse_math(answer)
    if not target:
        return False, False
    return True, bool(verify(gold, target, timeout_seconds=_math_verify_timeouts()["timeout_seconds"]))


class MathReward(RewardSource):
    """1.0 when the response's final answer (last ``\\boxed{}``, else its last expression) equals the label.

    Equality is math-verify's (Hugging Face, 2025): symbolic and numeric, so '1/2' equals '0.5'
    and '\\frac{1}{2}'. A label without ``$`` delimiters is read as LaTeX, like a boxed answer
    ('2\\sqrt{3}', '\\$18.90', '-2, 1'). Metric ``answer_found``: 1.0 when the response had an answer to check.
    """

    description = "math reward"

    def _score(self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]) -> RewardResult:
        rewards, found = [], []
        for i, (response, label) in enumerate(zip(responses, labels)):
            if label_is_missing(label):
                raise RewardError(f"{self.description}: {describe_sample(prompts, i)} has no label to check against")
            try:
                has_answer, correct = math_answer_is_correct(response, label)
            except ValueError as err:
                raise RewardError(f"{self.description}: {describe_sample(prompts, i)}: {err}") from None
            rewards.append(1.0 if correct else 0.0)
            found.append(1.0 if has_answer else 0.0)
        return RewardResult(rewards=rewards, metrics={"answer_found": found})


def normalize_whitespace(text: str) -> str:
    """Strip the ends and turn every run of whitespace into one space."""
    return " ".join(text.split())


class ExactMatchReward(RewardSource):
    """1.0 when the response equals the label after whitespace normalisation (and lower-casing if asked)."""

    description = "exact-match reward"

    def __init__(self, case_sensitive: bool = True):
        self.case_sensitive = case_sensitive

    def _normal(self, text: str) -> str:
        text = normalize_whitespace(text)
        return text if self.case_sensitive else text.casefold()

    def _score(self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]) -> RewardResult:
        rewards = []
        for i, (response, label) in enumerate(zip(responses, labels)):
            if label_is_missing(label):
                raise RewardError(f"{self.description}: {describe_sample(prompts, i)} has no label to compare with")
            try:
                text = label_text(label, numbers=False)
            except ValueError as err:
                raise RewardError(f"{self.description}: {describe_sample(prompts, i)}: {err}") from None
            rewards.append(1.0 if self._normal(response) == self._normal(text) else 0.0)
        return RewardResult(rewards=rewards)


class FormatReward(RewardSource):
    """1.0 when the whole response matches ``pattern`` (``re.fullmatch`` with DOTALL); labels are ignored."""

    description = "format reward"

    def __init__(self, pattern: str):
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as err:
            raise ValueError(f"format reward: invalid regex {pattern!r}: {err}") from None

    def _score(self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]) -> RewardResult:
        return RewardResult(rewards=[1.0 if self.regex.fullmatch(r) else 0.0 for r in responses])
