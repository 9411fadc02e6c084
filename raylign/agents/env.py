"""The environment API: what a user writes to train an agent.

An environment is a Python class; one instance plays one episode::

    class MyEnv:
        def __init__(self, **env_args): ...
        def reset(self, prompt, label, metadata):       # -> the first observation
            return [{"role": "user", "content": prompt}]
        def step(self, action_text, action_token_ids):  # -> observation, reward, done, info
            return {"role": "tool", "content": "..."}, 0.0, False, {"tool_calls": 1}

Either method may be ``async``; a blocking one runs in a thread, so a slow episode never holds
back the others. The constructor runs on the event loop all episodes share (it may create what
needs a running loop): keep it quick, and do slow set-up in ``reset``, which
``agent.step_timeout_s`` bounds. An observation is a message (``{"role", "content"}``), a list of messages, or a
plain string (a user message); a step that ends the episode may return ``None``. ``reward`` is
this turn's reward, a number (numpy scalars too); the episode's reward is the sum of its turns'.
``info`` is a dict of counts for the logs; two keys mean something: ``tool_calls`` (how many tools
the turn called) and ``tool_failures`` (a list of failure kinds, e.g. ``["timeout"]``).
``close()``, if defined, is called once when the episode ends, however it ends.

``agent.env`` names the class: ``path/to/env.py:ClassName`` or ``package.module:ClassName``.
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass, field
from typing import Any

from raylign.user_code import load_callable

Message = dict[str, Any]


@dataclass
class StepResult:
    """What :meth:`step` returns, checked: messages to append, this turn's reward, whether the
    episode is over, and counts for the logs."""

    observation: list[Message]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """A base class to inherit from (optional: any class with ``reset`` and ``step`` will do)."""

    def reset(self, prompt: Any, label: Any, metadata: dict[str, Any]) -> Any:
        raise NotImplementedError

    def step(self, action_text: str, action_token_ids: list[int]) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode holds (a no-op unless overridden)."""


def as_messages(observation: Any, where: str) -> list[Message]:
    """An observation as a list of chat messages; a TypeError naming ``where`` for anything else."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if not isinstance(observation, (list, tuple)):
        raise TypeError(
            f"{where}: an observation must be a message dict, a list of them or a string, got "
            f"{type(observation).__name__}"
        )
    messages = []
    for i, message in enumerate(observation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TypeError(f"{where}: message {i} must be a dict with a 'role' string, got {message!r:.80}")
        if not isinstance(message.get("content", ""), str):
            raise TypeError(f"{where}: message {i}'s content must be a string")
        messages.append(dict(message))
    return messages


def as_step_result(value: Any, where: str) -> StepResult:
    """``(observation, reward, done, info)`` or a :class:`StepResult`, checked."""
    if isinstance(value, StepResult):
        value = (value.observation, value.reward, value.done, value.info)
    if not isinstance(value, tuple) or len(value) != 4:
        raise TypeError(f"{where}: step() must return (observation, reward, done, info), got {value!r:.80}")
    observation, reward, done, info = value
    reward = as_number(reward, f"{where}: step() returned reward")
    if info is not None and not isinstance(info, dict):
        raise TypeError(f"{where}: step() returned info of type {type(info).__name__}; it must be a dict")
    return StepResult(as_messages(observation, where), reward, bool(done), dict(info or {}))


def as_number(value: Any, what: str) -> float:
    """``value`` as a float: a Python or numpy number or bool (``np.float32``, ``np.int64``, ``np.bool_``:
    what user code computing a reward with numpy returns). Anything else (a string, a list, None) is a
    TypeError that starts with ``what`` (the function that returned it) and shows the value."""
    import numpy as np

    # numpy registers its integer and floating types as numbers.Real, but not np.bool_.
    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    raise TypeError(
        f"{what} {value!r:.60}; it must be a number (int, float, bool or a numpy scalar), not {type(value).__name__}"
    )


async def call(method: Any, *args: Any) -> Any:
    """``method(*args)``, awaited if it is a coroutine function, else run in a thread."""
    import asyncio

    if inspect.iscoroutinefunction(method):
        return await method(*args)
    return await asyncio.to_thread(method, *args)


def load_environment(spec: str) -> type:
    """The class ``spec`` names: ``path/to/file.py:ClassName`` or ``package.module:ClassName``."""
    cls = load_callable(spec, "agent.env")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"agent.env: {spec} has no {' or '.join(missing)} method (see raylign.agents.env)")
    return cls
