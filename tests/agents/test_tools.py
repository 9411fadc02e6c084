"""Tools: schemas from type hints, tool calls parsed from text, the safe calculator, answer matching,
and the calculator and sandboxed Python environments."""

from __future__ import annotations

import asyncio
import json
import re
import time

import numpy as np
import pytest

from raylign.agents.tools import (
    CalculatorEnv,
    PythonEnv,
    Tool,
    ToolCall,
    ToolEnv,
    ToolError,
    calculator,
    evaluate_arithmetic,
    last_number,
    numeric_match,
    parse_tagged_calls,
    parse_tool_calls,
    tool,
)
from raylign.config.agent import AgentConfig


def call_block(name: str, arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# ---- tool ------------------------------------------------------------------------------------


def test_tool_schema_comes_from_type_hints_and_docstring():
    @tool
    def search(query: str, limit: int, scale: float, exact: bool, tags: list, filters: dict, note="", page: int = 1):
        """Search the notes
        for a query.

        Returns the matching lines."""

    assert isinstance(search, Tool)
    assert search.schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes for a query.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "scale": {"type": "number"},
                    "exact": {"type": "boolean"},
                    "tags": {"type": "array"},
                    "filters": {"type": "object"},
                    "note": {"type": "string"},  # no hint: a string
                    "page": {"type": "integer"},
                },
                "required": ["query", "limit", "scale", "exact", "tags", "filters"],
            },
        },
    }


def test_tool_takes_a_name():
    def add(a: int, b: int) -> int:
        return a + b

    assert tool(add, name="plus").name == "plus"


def test_tool_rejects_an_unsupported_hint():
    def lookup(key: int | None) -> str:
        return ""

    with pytest.raises(TypeError, match="tool lookup: parameter 'key' has type"):
        tool(lookup)


def test_a_sync_tool_and_an_async_tool_are_awaited_with_keyword_arguments():
    @tool
    def add(a: int, b: int = 10) -> int:
        return a + b

    @tool
    async def multiply(a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a * b

    assert asyncio.run(add({"a": 2, "b": 3})) == 5
    assert asyncio.run(add({"a": 2})) == 12
    assert asyncio.run(multiply({"a": 6, "b": 7})) == 42


# ---- parse_tool_calls --------------------------------------------------------------------------


def test_one_valid_block():
    text = 'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    assert parse_tool_calls(text) == ([ToolCall("calculator", {"expression": "1+2"})], [])


def test_two_blocks_in_order():
    text = call_block("calculator", {"expression": "1+2"}) + " and " + call_block("python", {"code": "print(1)"})
    assert parse_tool_calls(text) == (
        [ToolCall("calculator", {"expression": "1+2"}), ToolCall("python", {"code": "print(1)"})],
        [],
    )


def test_no_block_is_no_call():
    assert parse_tool_calls("The answer is 3.") == ([], [])


def test_invalid_json_is_an_error():
    calls, errors = parse_tool_calls('<tool_call>{"name": "calculator", </tool_call>')
    assert calls == []
    assert len(errors) == 1 and errors[0].startswith("tool call is not valid JSON")


def test_a_call_without_a_name_is_an_error():
    calls, errors = parse_tool_calls('<tool_call>{"arguments": {"expression": "1"}}</tool_call>')
    assert calls == []
    assert len(errors) == 1 and errors[0].startswith("tool call needs a 'name'")


def test_arguments_written_as_a_json_string_are_decoded():
    text = call_block("calculator", json.dumps({"expression": "2*3"}))
    assert parse_tool_calls(text) == ([ToolCall("calculator", {"expression": "2*3"})], [])


def test_arguments_that_are_not_an_object_are_an_error():
    calls, errors = parse_tool_calls(call_block("calculator", [1, 2]))
    assert calls == []
    assert len(errors) == 1 and errors[0].startswith("tool call arguments must be an object")


def test_a_bad_call_next_to_a_good_one_keeps_the_good_one():
    text = '<tool_call>{"oops"}</tool_call>' + call_block("calculator", {"expression": "4"})
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "4"})]
    assert len(errors) == 1


def test_an_unclosed_call_followed_by_a_long_run_of_whitespace_is_parsed_quickly():
    # A degenerate turn (an opening tag, then thousands of spaces and newlines) must not stall the
    # event loop that parses it: the time has to grow linearly with the text, not with its cube.
    text = "<tool_call>" + " \n" * 1500
    started = time.monotonic()
    calls, errors = parse_tool_calls(text)
    assert time.monotonic() - started < 1.0
    assert calls == []
    assert errors == ["tool call is not closed (no </tool_call>): <tool_call>" + " \n" * 34 + " "]


def test_thousands_of_unclosed_openings_are_parsed_quickly():
    # "<tool_call>" is one token in Qwen's vocabulary: a degenerate turn may repeat it thousands of times.
    text = "<tool_call>" * 8000
    started = time.monotonic()
    calls, errors = parse_tool_calls(text)
    assert time.monotonic() - started < 1.0
    assert calls == []
    assert len(errors) == 8000
    assert errors[0] == "tool call is not closed (no </tool_call>): " + "<tool_call>" * 7 + "<to"
    assert errors[-1] == "tool call is not closed (no </tool_call>): <tool_call>"


def test_thousands_of_unclosed_tagged_openings_are_parsed_quickly():
    text = "<calculator>" * 8000
    started = time.monotonic()
    calls, errors = parse_tagged_calls(text, {"calculator": calculator})
    assert time.monotonic() - started < 1.0
    assert (calls, len(errors)) == ([], 8000)


def test_a_tagged_call_after_unclosed_openings_still_runs():
    text = "<calculator>oops <calculator> 2*3 </calculator> <calculator>"
    calls, errors = parse_tagged_calls(text, {"calculator": calculator})
    assert calls == [ToolCall("calculator", {"expression": "oops <calculator> 2*3"})]
    assert errors == ["tool call is not closed (no </calculator>): <calculator>"]


def test_whitespace_around_the_json_of_a_call_is_ignored():
    text = "<tool_call>\n\t " + '{"name": "calculator", "arguments": {"expression": "1+2"}}' + " \n\n</tool_call>"
    assert parse_tool_calls(text) == ([ToolCall("calculator", {"expression": "1+2"})], [])


# ---- evaluate_arithmetic -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123*456", 56088),
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("2 ** 3 ** 2", 512),  # right-associative: 2 ** 9
        ("-3 + +5", 2),
        ("7 / 2", 3.5),
        ("8 / 2", 4),  # a whole float comes back as an int
        ("7 // 2", 3),
        ("7 % 3", 1),
        ("1.5 * 4", 6),
        (" 10 - 4 - 3 ", 3),
    ],
)
def test_arithmetic_values(expression, value):
    result = evaluate_arithmetic(expression)
    assert result == value
    assert type(result) is type(value)


@pytest.mark.parametrize(
    "expression",
    ["__import__('os')", "a+1", "(1).real", "abs(-1)", "[1, 2]", "True + 1", "'1' * 3", "1 if 1 else 2"],
)
def test_anything_but_arithmetic_is_refused(expression):
    with pytest.raises(ToolError) as raised:
        evaluate_arithmetic(expression)
    assert raised.value.kind == "bad_arguments"


def test_a_huge_exponent_is_refused():
    with pytest.raises(ToolError, match="exponent 100000 is too large"):
        evaluate_arithmetic("9 ** 100000")


def test_a_huge_result_is_refused():
    with pytest.raises(ToolError, match="result too large"):
        evaluate_arithmetic("(10 ** 60) * (10 ** 60)")


def test_a_float_power_beyond_the_float_range_is_refused():
    with pytest.raises(ToolError, match="result too large") as raised:
        evaluate_arithmetic("1e300 ** 2")
    assert raised.value.kind == "bad_arguments"


def test_a_complex_result_is_refused():
    with pytest.raises(ToolError, match="not a real number"):
        evaluate_arithmetic("(-8) ** 0.5")


@pytest.mark.parametrize("expression", ["1 / 0", "5 // 0", "5 % 0"])
def test_division_by_zero_is_refused(expression):
    with pytest.raises(ToolError, match="division by zero"):
        evaluate_arithmetic(expression)


def test_unparseable_text_is_refused():
    with pytest.raises(ToolError, match="cannot parse"):
        evaluate_arithmetic("1 +* 2")


# ---- answers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The answer is 56,088.", 56088.0),
        ("first 3, then 4.5", 4.5),
        ("it is -12 degrees", -12.0),
        ("no numbers here", None),
        ("the roots are 1,2,3", 3.0),  # a list, not one thousand-grouped number (123)
        ("the point (3,4)", 4.0),
        ("about 1e5 atoms", 100000.0),
        ("it is \u22127 degrees", -7.0),  # a Unicode minus sign
        ("12,345.5 in all", 12345.5),
    ],
)
def test_last_number(text, number):
    assert last_number(text) == number


@pytest.mark.parametrize(
    ("answer", "label", "reward"),
    [
        ("The answer is 56,088.", 56088, 1.0),
        ("The answer is 56,088.", "56088", 1.0),
        ("The answer is 56,089.", 56088, 0.0),
        ("so 0.1 + 0.2 = 0.3", 0.1 + 0.2, 1.0),  # within 1e-6
        ("I do not know", 5, 0.0),
        ("The answer is 1000", "1,000", 1.0),  # a text label is read the way answers are
        ("The answer is -7", "\u22127", 1.0),
        ("The answer is 1000", "$1000", 1.0),
    ],
)
def test_numeric_match(answer, label, reward):
    assert numeric_match(answer, label) == reward


@pytest.mark.parametrize(
    ("label", "problem"),
    [
        (None, "the label None is not a number"),  # a misnamed label key: every label None
        ("", "the label '' is not a number"),
        ("five", "the label 'five' is not a number"),
        ("3 or 4", "the label '3 or 4' is not a number"),
        (True, "the label True is not a number"),
        ([1000], "the label [1000] is not a number"),
        (float("nan"), "the label nan is not a finite number"),
        (10**400, "is not a finite number"),
    ],
)
def test_a_label_that_is_not_one_number_is_an_error_not_a_wrong_answer(label, problem):
    # It used to score 0.0 for every answer: a prompt file whose label key was misnamed trained on zeros.
    with pytest.raises(ValueError, match=re.escape(problem)):
        numeric_match("The answer is 5", label)


# ---- CalculatorEnv -----------------------------------------------------------------------------


def step(env, text: str):
    return asyncio.run(env.step(text, []))


def test_calculator_reset_starts_with_a_system_message_describing_the_tool():
    env = CalculatorEnv()
    messages = env.reset("What is 123*456?", 56088, {})
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1] == {"role": "user", "content": "What is 123*456?"}
    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": 'Evaluate an arithmetic expression such as "123 * 456" (+ - * / // % ** and parentheses).',
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
    assert json.dumps(schema) in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]


def test_calculator_reset_without_a_system_prompt():
    env = CalculatorEnv(system_prompt="")
    assert env.reset("What is 2+2?", 4, {}) == [{"role": "user", "content": "What is 2+2?"}]


def test_a_calculator_call_returns_its_value_as_a_tool_message():
    env = CalculatorEnv(system_prompt="")
    env.reset("What is 123*456?", 56088, {})
    assert step(env, "Let me compute. " + call_block("calculator", {"expression": "123*456"})) == (
        [{"role": "tool", "content": "56088"}],
        0.0,
        False,
        {"tool_calls": 1, "tool_failures": []},
    )


def test_the_tool_role_is_configurable():
    env = CalculatorEnv(system_prompt="", tool_role="user")
    env.reset("q", 3, {})
    observation, *_ = step(env, call_block("calculator", {"expression": "1+2"}))
    assert observation == [{"role": "user", "content": "3"}]


@pytest.mark.parametrize(
    ("call_format", "text", "tag"),
    [
        ("json", '<tool_call>{"name": "calculator", "arguments": {"expression": "1*12"}}', "tool_call"),
        ("tagged", "<calculator>1*12", "calculator"),
    ],
)
def test_a_call_left_unclosed_is_a_failed_call_not_the_final_answer(call_format, text, tag):
    # Label 12 and "1*12" in the text: graded as an answer, it would score 1 and end the episode.
    env = CalculatorEnv(system_prompt="", call_format=call_format)
    env.reset("What is 1*12?", 12, {})
    observation, reward, done, info = step(env, "Let me compute. " + text)
    assert (reward, done, info) == (0.0, False, {"tool_calls": 1, "tool_failures": ["bad_call"]})
    assert observation == [{"role": "tool", "content": f"error: tool call is not closed (no </{tag}>): {text}"}]


def test_a_closed_call_beside_an_unclosed_one_still_runs():
    env = CalculatorEnv(system_prompt="")
    env.reset("q", 3, {})
    text = call_block("calculator", {"expression": "1+2"}) + " <tool_call>{"
    observation, _, done, info = step(env, text)
    assert [m["content"] for m in observation] == [
        "error: tool call is not closed (no </tool_call>): <tool_call>{",
        "3",
    ]
    assert (done, info["tool_failures"]) == (False, ["bad_call"])


@pytest.mark.parametrize(("answer", "reward"), [("The answer is 56,088.", 1.0), ("The answer is 56,000.", 0.0)])
def test_an_answer_ends_the_episode_with_its_reward(answer, reward):
    env = CalculatorEnv(system_prompt="")
    env.reset("What is 123*456?", 56088, {})
    assert step(env, answer) == (None, reward, True, {})


def test_an_unknown_tool_is_an_error_result():
    env = CalculatorEnv(system_prompt="")
    env.reset("q", 1, {})
    observation, reward, done, info = step(env, call_block("search", {"query": "x"}))
    assert observation == [{"role": "tool", "content": "error: unknown tool 'search'; tools: calculator"}]
    assert (reward, done, info) == (0.0, False, {"tool_calls": 1, "tool_failures": ["unknown_tool"]})


def test_calls_beyond_max_tool_calls_are_refused():
    env = CalculatorEnv(system_prompt="", max_tool_calls=1)
    env.reset("q", 1, {})
    text = call_block("calculator", {"expression": "1+1"}) + call_block("calculator", {"expression": "2+2"})
    observation, _, done, info = step(env, text)
    assert observation == [
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "error: no more tool calls in this episode (at most 1)"},
    ]
    assert (done, info) == (False, {"tool_calls": 2, "tool_failures": ["too_many"]})


@pytest.mark.parametrize(
    ("arguments", "starts"),
    [
        ({"expr": "1+1"}, "error: wrong arguments for calculator"),
        ({"expression": "a+1"}, "error: not arithmetic"),
        ({"expression": "1/0"}, "error: division by zero"),
    ],
)
def test_bad_arguments_are_an_error_result(arguments, starts):
    env = CalculatorEnv(system_prompt="")
    env.reset("q", 1, {})
    (message,), _, done, info = step(env, call_block("calculator", arguments))
    assert message["content"].startswith(starts)
    assert (done, info) == (False, {"tool_calls": 1, "tool_failures": ["bad_arguments"]})


def test_an_unparseable_call_is_a_bad_call():
    env = CalculatorEnv(system_prompt="")
    env.reset("q", 1, {})
    (message,), _, done, info = step(env, '<tool_call>{"name": </tool_call>')
    assert message["content"].startswith("error: tool call is not valid JSON")
    assert (done, info) == (False, {"tool_calls": 1, "tool_failures": ["bad_call"]})


@pytest.mark.parametrize(("reward", "expected"), [(np.float32(0.5), 0.5), (np.int64(1), 1.0), (np.bool_(False), 0.0)])
def test_an_answer_reward_may_be_a_numpy_scalar(reward, expected):
    env = ToolEnv([calculator], system_prompt="", answer_reward=lambda answer, label: reward)
    env.reset("q", 1, {})
    assert step(env, "1") == (None, expected, True, {})


def test_an_answer_reward_that_is_not_a_number_is_a_type_error_naming_it():
    def graded_in_words(answer, label):
        return "correct"

    env = ToolEnv([calculator], system_prompt="", answer_reward=graded_in_words)
    env.reset("q", 1, {})
    message = r"answer_reward .*graded_in_words returned 'correct'; it must be a number"
    with pytest.raises(TypeError, match=message):
        step(env, "1")


@tool
async def wait(seconds: float) -> str:
    """Wait, then say so."""
    await asyncio.sleep(seconds)
    return f"waited {seconds:g} s"


def test_the_tool_calls_of_a_turn_share_its_budget_and_a_call_cut_short_says_so():
    # 0.5 s for the turn: the first call (0.2 s) runs, the second (5 s) is stopped when the budget is
    # spent, the third is not run. Each call alone would have had tool_timeout_s (10 s).
    env = ToolEnv([wait], system_prompt="", tool_timeout_s=10.0, step_budget_s=0.5)
    env.reset("q", 1, {})
    text = "".join(call_block("wait", {"seconds": s}) for s in (0.2, 5, 0.01))
    start = time.monotonic()
    observation, reward, done, info = step(env, text)
    seconds = time.monotonic() - start
    first, cut, not_run = (m["content"] for m in observation)
    assert first == "waited 0.2 s"
    budget = "the tool calls of one turn may take 0.5 s in all"
    assert re.fullmatch(r"error: wait was stopped after 0\.\d s: " + re.escape(budget), cut)
    assert not_run == f"error: wait was not run: {budget}"
    assert (reward, done, info) == (0.0, False, {"tool_calls": 3, "tool_failures": ["step_budget", "step_budget"]})
    assert 0.5 <= seconds < 1.0


# ---- PythonEnv (a real sandbox) ----------------------------------------------------------------


@pytest.fixture
def python_env():
    env = PythonEnv(system_prompt="", cpu_time_s=1, wall_time_s=3)
    env.reset("What is 6*7?", 42, {})
    return env


def test_python_prints_its_result(python_env):
    assert step(python_env, call_block("python", {"code": "print(6*7)"})) == (
        [{"role": "tool", "content": "42\n"}],
        0.0,
        False,
        {"tool_calls": 1, "tool_failures": []},
    )


def test_an_endless_loop_is_a_failed_call_and_the_episode_goes_on(python_env):
    (message,), reward, done, info = step(python_env, call_block("python", {"code": "while True: pass"}))
    assert message["role"] == "tool" and message["content"].startswith("error: ")
    assert (reward, done, info["tool_calls"]) == (0.0, False, 1)
    assert info["tool_failures"] in (["cpu_time"], ["timeout"])
    assert step(python_env, "It is 42.") == (None, 1.0, True, {})


def test_template_tools_hands_the_schemas_to_the_chat_template_instead_of_the_system_message():
    env = CalculatorEnv(template_tools=True)
    assert env.tools == [calculator.schema]
    assert env.reset("1 + 1 = ?", 2, {}) == [{"role": "user", "content": "1 + 1 = ?"}]
    described = CalculatorEnv()
    assert described.tools is None
    assert '"name": "calculator"' in described.reset("q", 0, {})[0]["content"]


def test_slow_python_calls_stop_within_the_turns_budget():
    # Three calls of 1.5 s each, a budget of 2.5 s: the first prints, the second is stopped (its sandbox
    # killed) when the budget is spent, the third is not run. Before the budget, each call could take
    # wall_time_s + 5 s, and a turn of several outlasted agent.step_timeout_s.
    env = PythonEnv(system_prompt="", wall_time_s=5.0, step_budget_s=2.5)
    env.reset("q", 1, {})
    code = "import time; time.sleep(1.5); print('slept')"
    start = time.monotonic()
    observation, _, _, info = step(env, call_block("python", {"code": code}) * 3)
    seconds = time.monotonic() - start
    first, cut, not_run = (m["content"] for m in observation)
    assert first == "slept\n"
    assert cut.startswith("error: python was stopped after ") and not_run.startswith("error: python was not run: ")
    assert info["tool_failures"] == ["step_budget", "step_budget"]
    assert seconds < 2.5 + 1.0


def test_the_default_budget_of_a_turns_tool_calls_fits_the_default_step_timeout():
    assert PythonEnv().step_budget_s < AgentConfig().step_timeout_s
    assert CalculatorEnv().step_budget_s < AgentConfig().step_timeout_s


@pytest.mark.parametrize(
    "value, text",
    [
        ({"found": True, "page": None, "title": "Zürich"}, '{"found": true, "page": null, "title": "Zürich"}'),
        ([1, 2.5, "a"], '[1, 2.5, "a"]'),
        (False, "false"),
        (42, "42"),
        ("as it is: {'a': 1}", "as it is: {'a': 1}"),
        ({1, 2}, "{1, 2}"),  # not JSON: str()
    ],
)
def test_a_tools_return_value_reaches_the_model_as_json_text(value, text):
    @tool
    def lookup(query: str) -> object:
        """Look something up."""
        return value

    env = ToolEnv([lookup], system_prompt="")
    env.reset("q", 1, {})
    observation, _, _, info = step(env, call_block("lookup", {"query": "x"}))
    assert observation == [{"role": "tool", "content": text}]
    assert info["tool_failures"] == []
