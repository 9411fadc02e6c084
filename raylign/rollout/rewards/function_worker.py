"""What runs inside the worker processes of :class:`~raylign.rollout.rewards.function.PythonFileReward`.

Kept apart and light (no torch, no Ray) because every spawned worker imports this module.
Failures come back as text, since a user's exception object may not survive pickling.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_LOADED: dict[tuple[str, str], Callable[..., Any]] = {}


class RewardFileError(ValueError):
    """The reward file cannot be imported, or lacks a callable of the given name."""


def ignore_interrupts() -> None:
    """Run first in each worker: Ctrl+C in a terminal reaches the whole process group, and the
    process that owns the pool decides what stops (a server drains its requests first)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def load_reward_function(path: str, function_name: str) -> Callable[..., Any]:
    """Import ``path`` as a module (once per process) and return its ``function_name``."""
    key = (path, function_name)
    if key in _LOADED:
        return _LOADED[key]
    file = Path(path)
    if not file.is_file():
        raise RewardFileError(f"reward file {path} does not exist")
    module_name = "raylign_reward_file_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise RewardFileError(f"reward file {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so pickling and dataclasses inside the file find it
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[module_name]
        raise RewardFileError(f"importing reward file {path} failed:\n{_format(err)}") from None
    function = getattr(module, function_name, None)
    if function is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardFileError(f"reward file {path} defines no '{function_name}' (callables in it: {public or 'none'})")
    if not callable(function):
        raise RewardFileError(f"'{function_name}' in reward file {path} is a {type(function).__name__}, not a function")
    _LOADED[key] = function
    return function


def _format(err: BaseException, skip_frames: int = 0) -> str:
    """The traceback as text, without the first ``skip_frames`` frames (this module's own)."""
    tb = err.__traceback__
    for _ in range(skip_frames):
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    return "".join(traceback.format_exception(type(err), err, tb)).rstrip()


def summarize(err: BaseException) -> str:
    """'ValueError: message' (the last line of a traceback)."""
    return "".join(traceback.format_exception_only(type(err), err)).strip()


def check_loadable(path: str, function_name: str) -> str | None:
    """Load the function in this worker; the error text if that fails, else None."""
    try:
        load_reward_function(path, function_name)
    except RewardFileError as err:
        return str(err)
    return None


def accepted_keywords(function: Callable[..., Any], names: list[str]) -> list[str]:
    """The metadata keys ``function`` can take: all with ``**kwargs``, else those it names."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: pass everything
        return names
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return names
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [n for n in names if n in named]


def call_reward_function(
    path: str,
    function_name: str,
    prompts: list[str],
    responses: list[str],
    labels: list[Any],
    metadata_columns: dict[str, list[Any]],
) -> tuple[str, Any]:
    """("ok", the function's return value), or ("error", (one-line cause, traceback text))."""
    try:
        function = load_reward_function(path, function_name)
    except RewardFileError as err:
        return "error", (str(err), "")
    keywords = {k: metadata_columns[k] for k in accepted_keywords(function, list(metadata_columns))}
    try:
        result = function(prompts, responses, labels, **keywords)
        if inspect.isawaitable(result):  # an async def function: run to its end here (the caller bounds the time)
            result = asyncio.run(_awaited(result))
        return "ok", result
    except BaseException as err:
        return "error", (summarize(err), _format(err, skip_frames=1))


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
