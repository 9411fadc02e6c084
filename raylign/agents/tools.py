"""Tools for agents: any Python function as a tool, tool calls parsed from the model's text, and
ready environments (a calculator, a Python interpreter in a sandbox).

A tool call is the model writing::

    <tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>

the format of the Hermes/Qwen chat templates' tool calls (a template without tool support gets the
tools described in the system message instead). For small models without a tool-call format of
their own there is a shorter tagged form, ``<calculator>123 * 456</calculator>``: the tool's name as
the tag around its one argument (tools with exactly one required parameter). Each call's
result comes back as a ``tool`` message. A tool that raises, times out or is called wrongly
gives the model an error message as its result and counts as a failed call of that kind; the
episode and the training step go on. A turn's calls run one after another and share one time
budget (``step_budget_s``), kept below ``agent.step_timeout_s`` so that a turn of slow calls ends
with results the model can read rather than the step's timeout, which cuts the turn off unrewarded.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from raylign.agents.env import Environment, Message, as_number, call

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass
class Tool:
    """A Python function the model may call, described by a JSON schema (OpenAI's function format)."""

    function: Callable[..., Any]
    name: str
    description: str
    parameters: dict[str, Any]

    @property
    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def __call__(self, arguments: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(self.function):
            return await self.function(**arguments)
        return await asyncio.to_thread(self.function, **arguments)


def tool(function: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Make ``function`` a :class:`Tool`: its name, its docstring's first paragraph as the description,
    and a JSON schema of its parameters from their type hints (int, float, str, bool, list, dict;
    parameters without a default are required). Usable as ``@tool`` or ``tool(f, name=...)``."""

    def make(f: Callable[..., Any]) -> Tool:
        hints = typing.get_type_hints(f)
        properties, required = {}, []
        for parameter in inspect.signature(f).parameters.values():
            hint = hints.get(parameter.name, str)
            if hint not in _JSON_TYPES:
                raise TypeError(
                    f"tool {f.__name__}: parameter {parameter.name!r} has type {hint!r}; a tool's parameters "
                    f"must be one of {', '.join(t.__name__ for t in _JSON_TYPES)}"
                )
            properties[parameter.name] = {"type": _JSON_TYPES[hint]}
            if parameter.default is inspect.Parameter.empty:
                required.append(parameter.name)
        description = inspect.cleandoc(f.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        parameters = {"type": "object", "properties": properties, "required": required}
        return Tool(f, name or f.__name__, description, parameters)

    return make(function) if function is not None else make


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The ``<tool_call>`` blocks of ``text``: the calls that parse, and an error for each one that does not."""
    calls, errors = [], []
    blocks, rest = split_calls(text, ["tool_call"])
    for block in (inner.strip() for _, inner in blocks):
        try:
            value = json.loads(block)
        except json.JSONDecodeError as err:
            errors.append(f"tool call is not valid JSON ({err.msg} at character {err.pos}): {block[:80]}")
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            errors.append(f"tool call needs a 'name': {block[:80]}")
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                errors.append(f"tool call arguments are not a JSON object: {arguments[:80]}")
                continue
        if not isinstance(arguments, dict):
            errors.append(f"tool call arguments must be an object: {block[:80]}")
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls, errors + unclosed_calls(rest, ["tool_call"])


def parse_tagged_calls(text: str, tools: dict[str, Tool]) -> tuple[list[ToolCall], list[str]]:
    """The ``<name>argument</name>`` calls of ``text``, for the tools of exactly one required parameter,
    and an error for each call left unclosed."""
    calls: list[ToolCall] = []
    single = {name: t.parameters["required"][0] for name, t in tools.items() if len(t.parameters["required"]) == 1}
    if not single:
        return calls, []
    blocks, rest = split_calls(text, list(single))
    for name, argument in blocks:
        calls.append(ToolCall(name, {single[name]: argument.strip()}))
    return calls, unclosed_calls(rest, list(single))


def split_calls(text: str, tags: list[str]) -> tuple[list[tuple[str, str]], str]:
    """The complete ``<tag>...</tag>`` blocks of ``text`` in order, as (tag, inner text) with each
    block ending at its tag's first closing, and the text without them.

    A scan, not a regex such as ``<tool_call>\\s*(.*?)\\s*</tool_call>``: a regex searches on to the end
    of the text from every unclosed opening, and its ``\\s*`` backtracks over runs of whitespace, so a
    degenerate turn (thousands of openings, or one before thousands of spaces) took seconds to minutes.
    Once a tag has no closing after some point, its later openings are not searched again."""
    opening = re.compile("<(" + "|".join(re.escape(tag) for tag in tags) + ")>")
    blocks, kept, start, closed_nowhere = [], [], 0, set()
    search_from = 0
    while match := opening.search(text, search_from):
        tag = match.group(1)
        end = -1 if tag in closed_nowhere else text.find(f"</{tag}>", match.end())
        if end < 0:
            closed_nowhere.add(tag)
            search_from = match.start() + 1
            continue
        kept.append(text[start : match.start()])
        blocks.append((tag, text[match.end() : end]))
        start = search_from = end + len(tag) + 3
    kept.append(text[start:])
    return blocks, "".join(kept)


def unclosed_calls(rest: str, tags: list[str]) -> list[str]:
    """An error for each opening ``<tag>`` left in ``rest`` (the text without its complete calls): a
    call cut off or never closed is a failed call the model is told about, not a final answer."""
    return [
        f"tool call is not closed (no </{tag}>): {rest[match.start() : match.start() + 80]}"
        for tag in tags
        for match in re.finditer(f"<{re.escape(tag)}>", rest)
    ]


# A number: thousands grouped by commas (1,000 or 12,345.5), else digits with a fraction or exponent;
# a Unicode minus (U+2212, as models trained on typeset text write) counts as a sign.
_NUMBER = re.compile(r"[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")


def last_number(text: str) -> float | None:
    """The last number written in ``text``, or None: '1,000' is 1000, but '1,2,3' ends with 3 and
    '(3,4)' with 4; '1e5' is 100000."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return _number_value(found[-1])


def _number_value(written: str) -> float:
    return float(written.replace(",", "").replace("\u2212", "-"))


def label_number(label: Any) -> float:
    """A numeric label as a float: a finite int or float, or text that writes one number the way answers
    are read ('1,000', '$1000', a Unicode minus); ValueError for anything else (None, 'four', '3 or 4', True)."""
    if isinstance(label, (int, float)) and not isinstance(label, bool):
        number = float(label) if not isinstance(label, int) or abs(label) < 2**1023 else math.inf
    elif isinstance(label, str) and len(found := _NUMBER.findall(label)) == 1:
        number = _number_value(found[0])
    else:
        raise ValueError(f"the label {label!r:.80} is not a number (one number, as text or a value)")
    if not math.isfinite(number):
        raise ValueError(f"the label {label!r:.80} is not a finite number")
    return number


def numeric_match(answer: str, label: Any) -> float:
    """1.0 when the last number of ``answer`` equals ``label`` (to 1e-6), else 0.0. A label that is not
    one number is a ValueError: a data problem (a missing or misnamed label key), not a wrong answer."""
    expected = label_number(label)
    got = last_number(answer)
    return float(got is not None and abs(got - expected) <= 1e-6 * max(1.0, abs(expected)))


def result_text(result: Any) -> str:
    """What the model reads of a tool's return value: a string as it is, any other value as JSON
    (``{"found": true, "page": null}``, the way OpenAI-style tool results are written, not Python's
    ``{'found': True, 'page': None}``); a value JSON cannot write (a set, an object) by ``str()``."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


class ToolEnv(Environment):
    """An episode of tool use: the model calls tools until it answers without a tool call; the answer's
    reward (``answer_reward(answer, label)``, default :func:`numeric_match`) ends the episode. The grader
    runs in a thread (or is awaited, if it is a coroutine function), so one that blocks ends its turn at
    ``agent.step_timeout_s`` instead of stopping every episode.

    ``system_prompt`` starts the conversation (None: a description of the tools and the call format;
    "": no system message). ``max_tool_calls`` calls at most per episode: beyond them a call gets an
    error result. ``tool_role`` is the role of result messages ("tool"; "user" for templates
    without one). ``call_format``: "json" (``<tool_call>`` blocks) or "tagged" (module docstring).
    ``template_tools``: hand the tools' schemas to the chat template (``tools``) instead of describing
    them in the system message, for models whose template renders tools itself (Qwen, Hermes).

    Each call may take ``tool_timeout_s``, and the calls of one turn together ``step_budget_s``: a
    call gets what is left of it (a call cut short, or not run because nothing is left, is a failed
    call of kind ``step_budget``). The episode runner refuses a budget that is not below
    ``agent.step_timeout_s``, whose timeout would end the episode without the turn's reward."""

    def __init__(
        self,
        tools: list[Tool],
        system_prompt: str | None = None,
        max_tool_calls: int = 4,
        tool_timeout_s: float = 10.0,
        tool_role: str = "tool",
        answer_reward: Callable[[str, Any], float] = numeric_match,
        call_format: Literal["json", "tagged"] = "json",
        template_tools: bool = False,
        step_budget_s: float = 25.0,
    ):
        if call_format not in ("json", "tagged"):
            raise ValueError(f"call_format must be 'json' or 'tagged', got {call_format!r}")
        self.call_format = call_format
        self.tool_list = {t.name: t for t in tools}
        # The episode runner passes an environment's ``tools`` to the chat template.
        self.tools = [t.schema for t in tools] if template_tools else None
        if system_prompt is None:
            system_prompt = "" if template_tools else self.describe()
        self.system_prompt = system_prompt
        self.max_tool_calls, self.tool_timeout_s, self.tool_role = max_tool_calls, tool_timeout_s, tool_role
        self.step_budget_s = step_budget_s
        self.answer_reward = answer_reward
        self.calls = 0
        self.label: Any = None

    def describe(self) -> str:
        schemas = "\n".join(json.dumps(t.schema) for t in self.tool_list.values())
        how = (
            "write <NAME>ARGUMENT</NAME>"
            if self.call_format == "tagged"
            else 'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
        )
        return (
            f"You can call these tools:\n{schemas}\nTo call one, {how} and wait for its result. "
            "When you know the answer, write it without a tool call."
        )

    def reset(self, prompt: Any, label: Any, metadata: dict[str, Any]) -> list[Message]:
        self.label, self.calls = label, 0
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if isinstance(prompt, list):
            return messages + [dict(m) for m in prompt]
        return messages + [{"role": "user", "content": str(prompt)}]

    async def step(self, action_text: str, action_token_ids: list[int]) -> tuple[Any, float, bool, dict[str, Any]]:
        errors: list[str] = []
        if self.call_format == "tagged":
            calls, errors = parse_tagged_calls(action_text, self.tool_list)
        else:
            calls, errors = parse_tool_calls(action_text)
        if not calls and not errors:  # an answer
            name = getattr(self.answer_reward, "__qualname__", type(self.answer_reward).__name__)
            # In a thread (or awaited, if async): a grader that blocks must not stop the loop every episode runs
            # on, whose agent.step_timeout_s then ends this turn.
            graded = await call(self.answer_reward, action_text, self.label)
            reward = as_number(graded, f"answer_reward {name} returned")
            return None, reward, True, {}
        results, failures = [], ["bad_call"] * len(errors)
        results += [f"error: {e}" for e in errors]
        deadline = time.monotonic() + self.step_budget_s
        for tool_call in calls:
            result, failure = await self._run(tool_call, deadline)
            results.append(result)
            if failure:
                failures.append(failure)
        observation = [{"role": self.tool_role, "content": r} for r in results]
        return observation, 0.0, False, {"tool_calls": len(calls) + len(errors), "tool_failures": failures}

    async def _run(self, call: ToolCall, deadline: float) -> tuple[str, str | None]:
        """A call's result text, and its failure kind (None when it worked); ``deadline`` (time.monotonic)
        ends the turn's budget."""
        self.calls += 1
        if self.calls > self.max_tool_calls:
            return f"error: no more tool calls in this episode (at most {self.max_tool_calls})", "too_many"
        chosen = self.tool_list.get(call.name)
        if chosen is None:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(self.tool_list)}", "unknown_tool"
        left = deadline - time.monotonic()
        if left <= 0:
            return self._over_budget(f"{call.name} was not run")
        timeout = min(self.tool_timeout_s, left)
        try:
            result = await asyncio.wait_for(chosen(call.arguments), timeout)
        except TimeoutError:
            if timeout < self.tool_timeout_s:
                return self._over_budget(f"{call.name} was stopped after {timeout:.1f} s")
            return f"error: {call.name} did not finish within {self.tool_timeout_s:g} s", "timeout"
        except TypeError as err:
            return f"error: wrong arguments for {call.name}: {err}", "bad_arguments"
        except ToolError as err:
            return f"error: {err}", err.kind
        except Exception as err:
            return f"error: {call.name} failed: {type(err).__name__}: {err}", "error"
        return result_text(result), None

    def _over_budget(self, what: str) -> tuple[str, str]:
        return f"error: {what}: the tool calls of one turn may take {self.step_budget_s:g} s in all", "step_budget"


class ToolError(Exception):
    """A tool's failure that the model should see, of a named kind (for the metrics)."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


# ---- the calculator ------------------------------------------------------------------------

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); nothing else is run.
    Powers are limited to exponents up to 64 and results to 10^100."""

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ToolError(f"exponent {right} is too large (at most 64)", "bad_arguments")
            result = _OPERATORS[type(node.op)](left, right)
            if isinstance(result, complex):  # a negative number to a fractional power
                raise ToolError("the result is not a real number", "bad_arguments")
            if abs(result) > 1e100:
                raise ToolError("result too large", "bad_arguments")
            return result
        raise ToolError(f"not arithmetic: {ast.unparse(node)[:40]!r}", "bad_arguments")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression[:60]!r} as arithmetic", "bad_arguments") from None
    try:
        result = value(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero", "bad_arguments") from None
    except OverflowError:  # float powers beyond the float range
        raise ToolError("result too large", "bad_arguments") from None
    return int(result) if isinstance(result, float) and result.is_integer() else result


@tool(name="calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as "123 * 456" (+ - * / // % ** and parentheses)."""
    return str(evaluate_arithmetic(expression))


class CalculatorEnv(ToolEnv):
    """Arithmetic questions with a calculator tool; the reward is the final answer's correctness."""

    def __init__(
        self,
        system_prompt: str | None = None,
        max_tool_calls: int = 4,
        tool_role: str = "tool",
        call_format: Literal["json", "tagged"] = "json",
        template_tools: bool = False,
        step_budget_s: float = 25.0,
    ):
        super().__init__(
            [calculator],
            system_prompt,
            max_tool_calls,
            tool_role=tool_role,
            call_format=call_format,
            template_tools=template_tools,
            step_budget_s=step_budget_s,
        )


# ---- Python in a sandbox -------------------------------------------------------------------


class PythonEnv(ToolEnv):
    """Questions answered with the help of a Python interpreter that runs in a sandbox
    (:mod:`raylign.agents.sandbox`: no network, a scratch folder, limits on time, memory,
    processes and disk space: ``max_disk_mb`` for all the files of one call, ``max_files`` files and
    folders). What the code prints
    is the tool's result; a sandbox failure is a failed call.
    A call may take ``wall_time_s`` (and a few seconds to start and stop the sandbox); the calls
    of one turn together ``step_budget_s`` (see :class:`ToolEnv`)."""

    def __init__(
        self,
        system_prompt: str | None = None,
        max_tool_calls: int = 4,
        tool_role: str = "tool",
        cpu_time_s: int = 5,
        wall_time_s: float = 10.0,
        memory_mb: int = 512,
        max_disk_mb: int = 64,
        max_files: int = 10_000,
        template_tools: bool = False,
        step_budget_s: float = 25.0,
    ):
        from raylign.agents.sandbox import SandboxLimits, run_python_async

        limits = SandboxLimits(
            cpu_time_s=cpu_time_s,
            wall_time_s=wall_time_s,
            memory_mb=memory_mb,
            max_disk_mb=max_disk_mb,
            max_files=max_files,
        )

        async def python(code: str) -> str:
            """Run Python code and return what it prints (no network; files only in its own folder)."""
            result = await run_python_async(code, limits)
            if not result.ok:
                raise ToolError(result.message, result.failure or "error")
            return result.stdout

        super().__init__(
            [tool(python)],
            system_prompt,
            max_tool_calls,
            tool_timeout_s=wall_time_s + 5,
            tool_role=tool_role,
            template_tools=template_tools,
            step_budget_s=step_budget_s,
        )
