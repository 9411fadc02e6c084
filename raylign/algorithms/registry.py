"""Name -> function registries, one per kind of algorithm.

A config string such as ``advantage.estimator: grpo`` selects a function with
``ADVANTAGE_ESTIMATORS.get("grpo")``. Adding an algorithm is one decorated function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """A named collection of functions of one kind (e.g. KL estimators).

    Each entry may carry metadata (e.g. ``needs_values=True`` for an advantage estimator
    that needs a critic) so callers can decide what to compute before calling it.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._functions: dict[str, Callable[..., Any]] = {}
        self._metadata: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **metadata: Any) -> Callable[[F], F]:
        """Decorator that registers a function under ``name``; a name can be registered once."""

        def decorator(fn: F) -> F:
            if name in self._functions:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._functions[name].__name__})")
            self._functions[name] = fn
            self._metadata[name] = dict(metadata)
            return fn

        return decorator

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered as ``name``; a KeyError lists the registered names otherwise."""
        try:
            return self._functions[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

    def metadata(self, name: str) -> dict[str, Any]:
        """Metadata given at registration (a copy); raises like :meth:`get` for unknown names."""
        self.get(name)
        return dict(self._metadata[name])

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._functions)

    def __contains__(self, name: object) -> bool:
        return name in self._functions

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


KL_ESTIMATORS = Registry("KL estimator")
ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
VALUE_LOSSES = Registry("value loss")
OFF_POLICY_CORRECTIONS = Registry("off-policy correction")
LOSS_AGGREGATIONS = Registry("loss aggregation")
REWARD_SHAPERS = Registry("reward shaper")
SAMPLE_FILTERS = Registry("sample filter")
PREFERENCE_LOSSES = Registry("preference loss")
REWARD_MODEL_LOSSES = Registry("reward-model loss")
DISTILLATION_LOSSES = Registry("distillation loss")
