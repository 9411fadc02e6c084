"""The agent section: multi-turn episodes against an environment instead of single completions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from raylign.config.base import Section


class AgentConfig(Section):
    """Multi-turn agent episodes (see :mod:`raylign.agents.env` for the environment API)."""

    env: str | None = Field(
        None,
        description="The environment class, 'path/to/env.py:ClassName' or 'package.module:ClassName' (ready ones: "
        "raylign.agents.tools:CalculatorEnv, raylign.agents.tools:PythonEnv). None: single-turn completions.",
    )
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment class, one instance per episode."
    )
    max_turns: int = Field(8, ge=1, description="Most policy turns in an episode (end reason max_turns).")
    max_total_tokens: int = Field(
        2048,
        ge=16,
        description="Most tokens in an episode, prompt and every turn (end reason max_tokens); also the "
        "rollout engines' context length when rollout.max_model_len is unset.",
    )
    episode_timeout_s: float = Field(
        300.0, gt=0, description="Wall time of one episode (end reason timeout); a turn in generation finishes first."
    )
    step_timeout_s: float = Field(
        30.0, gt=0, description="Longest call of the environment's reset/step (end reason step_timeout)."
    )
    drift: Literal["warn", "error"] = Field(
        "warn",
        description="A chat template that is not append-only (a fresh render of the conversation differs from the "
        "tokens so far): counted in agent/template_drift_turns and warned about, or an error that stops the run.",
    )
    log_trajectories: int = Field(
        2, ge=0, description="Full trajectories per step written to trajectories.jsonl, token sources marked."
    )
