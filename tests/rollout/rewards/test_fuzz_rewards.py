"""Fuzzed reward values: what a user's reward function returns and what a remote reward server answers.

A value is accepted as exactly the floats it stands for, or refused with a RewardError that names
the source (the function and its file, or the URL) and what was wrong: the sample whose value is
bad, the length, or the shape of the answer. Nothing else may escape (no OverflowError, TypeError
or RecursionError), and nothing odd is taken as a number (no strings, sets, nested lists).

Return values go through :func:`to_float_list` directly for many cases, and a bounded number
through a real :class:`PythonFileReward` (one worker process for the module). Answers come from
a real HTTP server on 127.0.0.1 serving each fuzzed status and body. Below the fuzz tests, plain
examples pin the exact message for the values that need particular care (integers beyond the float
range, 0-d and 2-d arrays, numbers as text, dict keys of mixed types, deep JSON, falsy metrics).
"""

from __future__ import annotations

import json
import math
import socket
import textwrap
import threading
import types
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raylign.rollout.rewards import HttpRewardSource, PythonFileReward, RewardError
from raylign.rollout.rewards.base import to_float_list
from tests.fuzz_cases import FUZZ, JSON_VALUES, count_case


def prompts_for(n: int) -> list[str]:
    return [f"p{i}" for i in range(n)]


# ---------------------------------------------------------------- what a reward function returns


@dataclass(frozen=True)
class Refused:
    """The error a value must get: ``kind`` is 'type', 'length', 'element' or 'missing_rewards'."""

    kind: str
    index: int = -1  # the bad sample, for 'element'; the wrong length, for 'length'


NUMBERS = st.floats(-1e6, 1e6, allow_subnormal=False) | st.integers(-(10**6), 10**6) | st.booleans()


def scalar_forms(with_torch: bool) -> st.SearchStrategy[tuple[Any, float]]:
    """(a number as a function may return it, the float it stands for)."""
    plain = NUMBERS.map(lambda x: (x, float(x)))
    numpy_float = st.floats(-1e6, 1e6, allow_subnormal=False).flatmap(
        lambda x: st.sampled_from([(np.float64(x), x), (np.float32(x), float(np.float32(x)))])
    )
    numpy_int = st.integers(-(10**6), 10**6).map(lambda x: (np.int64(x), float(x)))
    numpy_bool = st.booleans().map(lambda b: (np.bool_(b), float(b)))
    forms = [plain, plain, numpy_float, numpy_int, numpy_bool]
    if with_torch:
        forms.append(
            st.floats(-1e6, 1e6, allow_subnormal=False).map(lambda x: (torch.tensor(x, dtype=torch.float64), x))
        )
    return st.one_of(forms)


BAD_ELEMENTS = st.sampled_from(
    [
        math.nan,
        math.inf,
        -math.inf,
        None,
        "1.0",
        "",
        "nan",
        b"1",
        [1.0],
        (1.0,),
        {"r": 1.0},
        {1.0},
        1 + 2j,
        10**400,
        -(10**400),
        10**5000,
        np.float64("nan"),
        np.float32("inf"),
        np.complex128(1),
        np.str_("1"),
        np.array([1.0]),
        np.array(["1"]),
    ]
) | JSON_VALUES.filter(lambda v: isinstance(v, (str, list, dict)) or v is None)


@st.composite
def function_returns(draw: st.DrawFn, n: int, with_torch: bool) -> tuple[Any, list[float] | Refused]:
    """A return value for ``n`` samples and what must come of it: the floats, or the refusal."""
    kind = draw(st.sampled_from(["good", "good", "good", "bad_element", "wrong_length", "not_a_sequence"]))
    if kind == "not_a_sequence":
        odd = [
            "1.0",
            b"\x01" * n,
            bytearray(n),
            set(range(n)),
            frozenset(range(n)),
            range(n),
            None,
            1.0,
            3,
            True,
            np.float64(1.0),
            np.array(1.0),
            np.ones((n, 1)),
            np.ones((n, 2)),
            np.array([[1.0] * n]),
            (float(i) for i in range(n)),
        ]
        if with_torch:
            odd += [torch.tensor(1.0), torch.ones(n, 1)]
        return draw(st.sampled_from(odd)), Refused("type")
    if kind == "wrong_length":
        length = draw(st.integers(0, n + 3).filter(lambda m: m != n))
        return [0.5] * length, Refused("length", length)
    pairs = draw(st.lists(scalar_forms(with_torch), min_size=n, max_size=n))
    values, expected = [v for v, _ in pairs], [e for _, e in pairs]
    outcome: list[float] | Refused = expected
    if kind == "bad_element":
        index = draw(st.integers(0, n - 1))
        values[index] = draw(BAD_ELEMENTS)
        outcome = Refused("element", index)
    container = draw(st.sampled_from(["list", "tuple", "numpy", "torch"] if with_torch else ["list", "tuple", "numpy"]))
    if container == "tuple":
        return tuple(values), outcome
    if kind == "good" and container == "numpy":
        return np.array([float(v) for v in values], dtype=np.float64), outcome
    if kind == "good" and container == "torch":
        return torch.tensor([float(v) for v in values], dtype=torch.float64), outcome
    return values, outcome


def expected_fragment(refused: Refused, n: int, offset: int = 0) -> str:
    if refused.kind == "type":
        return f"expected a list of {n} numbers, got "
    if refused.kind == "length":
        return f"expected {n} values (one per sample), got {refused.index}"
    if refused.kind == "missing_rewards":
        return "a dict result needs a 'rewards' key"
    return f"value for sample {offset + refused.index} (prompt 'p{refused.index}') is not a"


@settings(FUZZ, max_examples=250)
@given(data=st.data(), n=st.integers(1, 5), offset=st.integers(0, 40))
def test_fuzzed_values_become_exactly_their_floats_or_a_reward_error_naming_the_sample(data, n, offset):
    count_case("rewards: to_float_list")
    values, outcome = data.draw(function_returns(n, with_torch=True))
    what = "reward function 'score' in /tmp/r.py returned a bad value"
    if isinstance(outcome, Refused):
        with pytest.raises(RewardError) as caught:
            to_float_list(values, n, what, prompts_for(n), offset)
        message = str(caught.value)
        assert message.startswith(what + ": ") and expected_fragment(outcome, n, offset) in message, message
        return
    result = to_float_list(values, n, what, prompts_for(n), offset)
    assert result == outcome and all(type(x) is float for x in result)


REWARD_FILE = """
def reward_func(prompts, responses, labels, **metadata):
    # the test hands the value to return over as the first sample's label
    return labels[0]
"""


@pytest.fixture(scope="module")
def reward_source(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz_rewards") / "echo_rewards.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    with PythonFileReward(path, num_workers=1, timeout_s=60) as source:
        yield source


@st.composite
def worker_returns(draw: st.DrawFn, n: int) -> tuple[Any, list[float] | Refused, str]:
    """A return value of the function (a list, or a dict with a metric), its outcome, and the part at fault."""
    rewards, outcome = draw(function_returns(n, with_torch=False))
    if isinstance(rewards, types.GeneratorType):  # a generator cannot be sent to the worker
        rewards, outcome = None, Refused("type")
    shape = draw(st.sampled_from(["plain", "plain", "dict", "dict_bad_metric", "dict_without_rewards"]))
    if shape == "plain":
        return rewards, outcome, "rewards"
    if shape == "dict_without_rewards":
        return {1: [0.0] * n, "reward": [0.0] * n, None: 0}, Refused("missing_rewards"), "rewards"
    if shape == "dict":
        return {"rewards": rewards, "score": [1.0] * n}, outcome, "rewards"
    metric, metric_outcome = draw(function_returns(n, with_torch=False).filter(lambda r: isinstance(r[1], Refused)))
    if isinstance(metric, types.GeneratorType):
        metric, metric_outcome = None, Refused("type")
    return {"rewards": rewards, "score": metric}, metric_outcome, "metric"


@settings(FUZZ, max_examples=40)
@given(data=st.data(), n=st.integers(1, 4))
def test_fuzzed_reward_function_returns_through_the_worker(data, n, reward_source):
    count_case("rewards: reward function file, through its worker")
    value, outcome, part = data.draw(worker_returns(n))
    labels = [value] + [None] * (n - 1)
    if not isinstance(outcome, Refused):
        result = reward_source.score(prompts_for(n), ["r"] * n, labels)
        assert result.rewards == outcome
        return
    with pytest.raises(RewardError) as caught:
        reward_source.score(prompts_for(n), ["r"] * n, labels)
    message = str(caught.value)
    noun = "sample" if n == 1 else "samples"
    assert message.startswith(
        f"{reward_source.description} returned a bad value for {n} {noun} starting at sample 0 (prompt 'p0')"
    ), message
    assert expected_fragment(outcome, n) in message, message
    assert ("(metric 'score')" in message) == (part == "metric"), message


# ---------------------------------------------------------------- what a reward server answers


@dataclass
class Answer:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    hang_up: bool = False  # close the connection without answering


class FuzzedAnswerHandler(BaseHTTPRequestHandler):
    answer = Answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        answer = type(self).answer
        if answer.hang_up:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type)
        self.send_header("Content-Length", str(len(answer.body)))
        self.end_headers()
        self.wfile.write(answer.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def answer_server():
    """(url, handler class): the server answers every request with ``handler.answer``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), FuzzedAnswerHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score", FuzzedAnswerHandler
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as JavaScript literals, as Python servers send them


def is_not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


NOT_A_LIST = JSON_VALUES.filter(lambda v: not isinstance(v, list))
BAD_NUMBERS = st.sampled_from([math.nan, math.inf, -math.inf, None, "1.0", True, False, [1.0], {"r": 1}, 10**400])


@st.composite
def server_answers(draw: st.DrawFn, n: int) -> tuple[Answer, list[float] | str]:
    """An answer for a batch of ``n`` and what must come of it: the rewards, or a phrase of the error."""
    kind = draw(
        st.sampled_from(
            [
                "good",
                "good",
                "not_json",
                "no_rewards",
                "rewards_not_a_list",
                "wrong_length",
                "bad_value",
                "bad_metrics",
                "bad_metric_value",
                "status",
                "hang_up",
                "huge_number",
                "deep",
            ]
        )
    )
    rewards = draw(st.lists(st.floats(-1e6, 1e6, allow_subnormal=False), min_size=n, max_size=n))
    if kind == "good":
        metrics = draw(st.none() | st.just({"m": [0.25] * n}))
        body = {"rewards": rewards} | ({} if metrics is None else {"metrics": metrics})
        return Answer(body=dumps(body)), rewards
    if kind == "not_json":
        text = draw(
            st.sampled_from(["", "{", '{"rewards": [1.0,', "<html>busy</html>", "rewards=1"])
            | st.text().filter(is_not_json)
        )
        return Answer(body=text.encode("utf-8", "surrogatepass")), "not valid JSON"
    if kind == "no_rewards":
        body = draw(JSON_VALUES.filter(lambda v: not (isinstance(v, dict) and "rewards" in v)))
        return Answer(body=dumps(body)), "has no 'rewards' field"
    if kind == "rewards_not_a_list":
        return Answer(body=dumps({"rewards": draw(NOT_A_LIST)})), "'rewards' in the answer is a"
    if kind == "wrong_length":
        length = draw(st.integers(0, n + 3).filter(lambda m: m != n))
        return Answer(body=dumps({"rewards": [1.0] * length})), f"the answer has {length} rewards for {n} samples"
    if kind == "bad_value":
        index = draw(st.integers(0, n - 1))
        rewards[index] = draw(BAD_NUMBERS)
        return Answer(body=dumps({"rewards": rewards})), f"(position {index}) in the answer is not a finite number"
    if kind == "bad_metrics":
        metrics = draw(JSON_VALUES.filter(lambda v: not isinstance(v, dict) and v is not None))
        return Answer(body=dumps({"rewards": rewards, "metrics": metrics})), "'metrics' in the answer is a"
    if kind == "bad_metric_value":
        return Answer(body=dumps({"rewards": rewards, "metrics": {"m": [None] * n}})), "metric 'm' value None"
    if kind == "status":
        status = draw(st.sampled_from([301, 400, 401, 403, 404, 405, 413, 418, 429, 500, 502, 503]))
        return Answer(status=status, body=b'{"detail": "no"}'), f"{status}"
    if kind == "hang_up":
        return Answer(hang_up=True), "connection failed"
    if kind == "huge_number":
        return Answer(body=b'{"rewards": [' + b"9" * 5000 + b"]}"), "not valid JSON"
    depth = draw(st.integers(2000, 4000))
    return Answer(body=b'{"rewards": ' + b"[" * depth + b"]" * depth + b"}"), "not valid JSON"


@settings(FUZZ, max_examples=60)
@given(data=st.data(), n=st.integers(1, 4))
def test_fuzzed_server_answers_become_rewards_or_a_reward_error_naming_the_url(data, n, answer_server):
    count_case("rewards: HTTP answers of a reward server")
    url, handler = answer_server
    answer, outcome = data.draw(server_answers(n))
    handler.answer = answer
    source = HttpRewardSource(url, timeout_s=5.0, max_retries=0, backoff_s=0.0)
    try:
        if isinstance(outcome, list):
            assert source.score(prompts_for(n), ["r"] * n).rewards == outcome
            return
        with pytest.raises(RewardError) as caught:
            source.score(prompts_for(n), ["r"] * n)
    finally:
        source.close()
    message = str(caught.value)
    noun = "sample" if n == 1 else "samples"
    assert message.startswith(f"HTTP reward source {url} failed on {n} {noun} starting at sample 0 (prompt 'p0')")
    assert outcome in message, message


# ---------------------------------------------------------------- examples that need particular care

WHAT = "reward function 'score' in /tmp/r.py returned a bad value"


def test_integer_beyond_the_float_range_is_named_not_an_overflow_error():
    with pytest.raises(RewardError) as caught:
        to_float_list([0.5, 10**400], 2, WHAT, ["p0", "p1"])
    assert str(caught.value) == (
        f"{WHAT}: value for sample 1 (prompt 'p1') is not a finite number: " + repr(10**400)[:77] + "..."
    )


def test_integer_too_long_to_print_is_described():
    with pytest.raises(RewardError) as caught:
        to_float_list([10**5000], 1, WHAT, ["p0"])
    assert (
        str(caught.value) == f"{WHAT}: value for sample 0 (prompt 'p0') is not a finite number: an integer of about "
        "5000 digits"
    )


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (np.array(1.0), "ndarray of shape ()"),
        (torch.tensor(1.0), "Tensor of shape ()"),
        (np.ones((2, 1)), "ndarray of shape (2, 1)"),
        (torch.ones(2, 1), "Tensor of shape (2, 1)"),
        ({0.0, 1.0}, "set"),
        (range(2), "range"),
        (bytearray(2), "bytearray"),
    ],
)
def test_values_that_are_not_a_flat_sequence_are_refused_naming_their_type(value, kind):
    with pytest.raises(RewardError) as caught:
        to_float_list(value, 2, WHAT, ["p0", "p1"])
    assert str(caught.value) == f"{WHAT}: expected a list of 2 numbers, got {kind}"


@pytest.mark.parametrize(
    ("element", "shown"), [("1.0", "'1.0'"), (np.array([1.0]), "array([1.])"), (np.str_("1"), "np.str_('1')")]
)
def test_numbers_written_as_text_or_wrapped_in_arrays_are_not_numbers(element, shown):
    with pytest.raises(RewardError) as caught:
        to_float_list([0.0, element], 2, WHAT, ["p0", "p1"])
    assert str(caught.value) == f"{WHAT}: value for sample 1 (prompt 'p1') is not a number: {shown}"


def test_numpy_scalars_and_zero_d_tensors_are_numbers():
    values = [np.float32(0.5), np.int64(3), np.bool_(True), torch.tensor(-2.25), True]
    assert to_float_list(values, 5, WHAT, prompts_for(5)) == [0.5, 3.0, 1.0, -2.25, 1.0]
    assert to_float_list(torch.tensor([1.5, -1.0]), 2, WHAT, prompts_for(2)) == [1.5, -1.0]


def test_dict_result_without_rewards_lists_keys_of_any_type(reward_source):
    with pytest.raises(RewardError) as caught:
        reward_source.score(["p0"], ["r"], [{1: [0.0], "reward": [0.0], None: 0}])
    assert str(caught.value).endswith("a dict result needs a 'rewards' key (got keys 'reward', 1, None)")


def answer_error(answer_server, answer: Answer, n: int = 1) -> str:
    url, handler = answer_server
    handler.answer = answer
    with HttpRewardSource(url, timeout_s=5.0, max_retries=0) as source, pytest.raises(RewardError) as caught:
        source.score(prompts_for(n), ["r"] * n)
    return str(caught.value)


def test_answer_nested_too_deeply_is_not_valid_json(answer_server):
    message = answer_error(answer_server, Answer(body=b'{"rewards": ' + b"[" * 3000 + b"]" * 3000 + b"}"))
    assert "after 1 attempts; last cause: the answer is not valid JSON: " in message


def test_answer_with_an_integer_beyond_the_float_range_names_its_position(answer_server):
    message = answer_error(answer_server, Answer(body=b'{"rewards": [0.5, 1' + b"0" * 400 + b"]}"), n=2)
    assert message.endswith(
        f"last cause: rewards value {repr(10**400)[:77]}... (position 1) in the answer is not a finite number"
    )


@pytest.mark.parametrize("metrics", [[], 0, "", False])
def test_answer_with_empty_metrics_of_the_wrong_type_is_refused(answer_server, metrics):
    message = answer_error(answer_server, Answer(body=dumps({"rewards": [1.0], "metrics": metrics})))
    assert message.endswith(f"last cause: 'metrics' in the answer is a {type(metrics).__name__}, not an object")
