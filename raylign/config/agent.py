"""The agent section: multi-turn episodes against an environment instead of single completions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from raylign.config.base import Section


class AgentConfig(Section):
    """Multi-turn agent episodes (see :mod:`raylign.agents.env` for the environment API)."""

    @model_validator(mode="after")
    def _one_kind(self) -> AgentConfig:
        if self.env is not None and self.client is not None:
            raise ValueError("agent.env and agent.client are two ways to play an episode: set one of them")
        if self.env_args and self.env is None:
            raise ValueError("agent.env_args are the arguments of the agent.env class, and agent.env is not set")
        return self

    @property
    def enabled(self) -> bool:
        return self.env is not None or self.client is not None

    env: str | None = Field(
        None,
        description="The environment class, 'path/to/env.py:ClassName' or 'package.module:ClassName' (ready ones: "
        "raylign.agents.tools:CalculatorEnv, raylign.agents.tools:PythonEnv). None: single-turn completions.",
    )
    client: str | None = Field(
        None,
        description="Instead of env: an agent function written against an OpenAI client, 'path/to/agent.py:run', "
        "called once per episode with a context (ctx.openai_client(), ctx.prompt, ctx.label); its requests go "
        "through the OpenAI-compatible endpoint to the rollout engines and are trained on. Returns the reward "
        "(or None and POSTs it to /v1/sessions/{id}/reward).",
    )
    endpoint_host: str = Field("127.0.0.1", description="Address the endpoint listens on (agent.client runs).")
    endpoint_port: int = Field(0, ge=0, le=65535, description="Port of the endpoint; 0 picks a free one.")
    api_key: str | None = Field(
        None, description="API key the endpoint requires (Authorization: Bearer <key>); None: no key."
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
        30.0,
        gt=0,
        description="Longest call of the environment's step (end reason step_timeout) or reset (past it the run "
        "stops, naming the row).",
    )
    drift: Literal["warn", "error"] = Field(
        "warn",
        description="A chat template that is not append-only (a fresh render of the conversation differs from the "
        "tokens so far): counted in agent/template_drift_turns and warned about, or an error that stops the run.",
    )
    log_trajectories: int = Field(
        2, ge=0, description="Full trajectories per step written to trajectories.jsonl, token sources marked."
    )
