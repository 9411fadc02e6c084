"""One multi-turn episode, token in and token out.

The conversation is kept as one growing token sequence. The policy's tokens are appended
exactly as the engine sampled them, never decoded and tokenised again; each environment turn
is rendered with the chat template and only the new part is appended::

    delta = render(messages + observation, add_generation_prompt=True)[len(decode(sequence)):]

so the tokens between two policy turns are the template's own (end of the assistant turn, the
tool or user message, the next assistant header). Every token records where it came from:
policy tokens are trained on (with the engine's log-prob and weight version), environment
tokens are masked out of the loss.

That works only if the template is *append-only*: rendering the longer conversation must start
with exactly the text of the sequence so far. Templates that rewrite earlier turns (dropping
past reasoning, moving a system prompt, numbering turns) are not; the drift check compares, at
every environment turn, the decoded sequence with a fresh render of the whole conversation, and
counts the turns where it is not a prefix (``agent.drift: error`` stops the run instead). The
sequence is then continued with the template's end of the policy's turn and the fresh render's
new part, and what was trained stays what was sampled.

Limits end an episode with a recorded reason, never a hang: ``max_turns`` policy turns,
``max_total_tokens`` (prompt and every turn), ``episode_timeout_s`` of wall time, and
``step_timeout_s`` for one call of the environment. Every turn the policy wrote is graded by its
``step``, with the whole ``step_timeout_s``, however the episode then ends: as the last turn of
``max_turns`` is, so is the turn being generated when the wall time runs out (it is finished first,
bounded by ``sampling.max_new_tokens``); the episode then ends with ``timeout``, unless the step
ended it. Only a step that fails leaves its turn without a reward (``step_timeout``,
``env_error``). A blocking ``step`` that hangs is abandoned in its thread (Python cannot stop a
thread); an ``async`` one is cancelled. An environment that declares ``step_budget_s``, the time its
``step`` may take (the tool environments do), must keep it below ``step_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from raylign.agents.env import Message, as_messages, as_step_result, call
from raylign.agents.response_text import SpecialTokens
from raylign.config.rollout import SamplingConfig
from raylign.rollout.base import Completion

logger = logging.getLogger(__name__)

# What ends an episode.
EndReason = Literal["done", "max_turns", "max_tokens", "timeout", "step_timeout", "env_error"]
END_REASONS: tuple[str, ...] = ("done", "max_turns", "max_tokens", "timeout", "step_timeout", "env_error")

# (token ids, sampling, request index) -> one completion; the index seeds seeded sampling.
Generate = Callable[[list[int], SamplingConfig, int], Awaitable[Completion]]


class TemplateDriftError(RuntimeError):
    """The chat template is not append-only and ``agent.drift`` is ``error``."""


class EnvironmentFailed(RuntimeError):
    """An environment could not start an episode (its ``reset`` raised or hung)."""


@dataclass
class EpisodeLimits:
    max_turns: int = 8
    max_total_tokens: int = 2048
    episode_timeout_s: float = 300.0
    step_timeout_s: float = 30.0
    drift: Literal["warn", "error"] = "warn"


@dataclass
class Episode:
    """A finished episode: the prompt, then every token after it with its source.

    ``token_ids[i]`` came from the policy where ``from_policy[i]`` (its engine log-prob is
    ``logprobs[i]``, its weight version ``versions[i]``), else from the environment (log-prob 0,
    the version of the policy token before it). ``turn_rewards`` holds ``(i, reward)`` for each
    environment step, ``i`` the last policy token of the turn it rewards.
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    from_policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    turns: int = 0
    end_reason: EndReason = "done"
    finish_reason: str = "stop"  # the last policy turn's ("length": it ran out of new tokens)
    weight_version: int = 0  # the weights that sampled the first turn
    tool_calls: int = 0
    tool_failures: dict[str, int] = field(default_factory=dict)
    drift_turns: int = 0  # environment turns at which the template was not append-only
    error: str | None = None  # what the environment raised (end_reason env_error)
    seconds: float = 0.0
    finished_at: float = 0.0  # wall-clock time (time.time()) when it ended

    @property
    def reward(self) -> float:
        return sum(r for _, r in self.turn_rewards)

    @property
    def policy_tokens(self) -> int:
        return sum(self.from_policy)

    def segments(self, tokenizer: Any) -> list[dict[str, Any]]:
        """The tokens after the prompt as runs of one source, decoded: for a readable log."""
        out: list[dict[str, Any]] = []
        start = 0
        for i in range(1, len(self.token_ids) + 1):
            if i == len(self.token_ids) or self.from_policy[i] != self.from_policy[start]:
                ids = self.token_ids[start:i]
                out.append(
                    {
                        "source": "policy" if self.from_policy[start] else "env",
                        "text": tokenizer.decode(ids, skip_special_tokens=False),
                        "tokens": len(ids),
                    }
                )
                start = i
        return out


class EpisodeRunner:
    """Plays episodes of one environment class against an engine (``generate``)."""

    def __init__(
        self,
        env_factory: Callable[[], Any],
        tokenizer: Any,
        limits: EpisodeLimits,
        generate_timeout_s: float = 600.0,
    ):
        self.env_factory, self.tokenizer, self.limits = env_factory, tokenizer, limits
        self.generate_timeout_s = generate_timeout_s
        # Every added special token, not only all_special_ids: a model may stop on an end token that only
        # its generation config names.
        self.special_ids = SpecialTokens.of(tokenizer).ids

    def render(self, messages: list[Message], env: Any, generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {}
        tools = getattr(env, "tools", None)
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    async def run(
        self,
        prompt: Any,
        label: Any,
        metadata: dict[str, Any],
        generate: Generate,
        sampling: SamplingConfig,
        request_index: int = 0,
        where: str = "episode",
    ) -> Episode:
        """Play one episode from ``prompt``; ``request_index`` numbers its engine requests (seeds)."""
        lim = self.limits
        start = time.perf_counter()
        deadline = start + lim.episode_timeout_s
        env = self.env_factory()
        try:
            self._check_step_budget(env, where)
            try:
                first = await asyncio.wait_for(call(env.reset, prompt, label, metadata), lim.step_timeout_s)
            except TimeoutError:
                raise EnvironmentFailed(
                    f"{where}: the environment's reset() did not return within agent.step_timeout_s="
                    f"{lim.step_timeout_s:g} s"
                ) from None
            except Exception as err:
                raise EnvironmentFailed(f"{where}: the environment's reset() raised {err!r}") from err
            messages = as_messages(first, f"{where}: reset()")
            if not messages:
                raise EnvironmentFailed(f"{where}: reset() returned no message to start the episode from")
            episode = Episode(self.encode(self.render(messages, env, True)), messages=messages)
            if len(episode.prompt_ids) >= lim.max_total_tokens:
                raise EnvironmentFailed(
                    f"{where}: the first observation is {len(episode.prompt_ids)} tokens, not less than "
                    f"agent.max_total_tokens={lim.max_total_tokens}"
                )
            await self._play(env, episode, generate, sampling, request_index, deadline, where)
        finally:
            await self._close(env, where)
        episode.seconds = time.perf_counter() - start
        episode.finished_at = time.time()
        return episode

    async def _play(
        self,
        env: Any,
        ep: Episode,
        generate: Generate,
        sampling: SamplingConfig,
        request_index: int,
        deadline: float,
        where: str,
    ) -> None:
        lim = self.limits
        while True:
            room = lim.max_total_tokens - len(ep.prompt_ids) - len(ep.token_ids)
            turn_sampling = sampling.model_copy(update={"n": 1, "max_new_tokens": min(sampling.max_new_tokens, room)})
            try:
                completion = await asyncio.wait_for(
                    generate(ep.prompt_ids + ep.token_ids, turn_sampling, request_index * lim.max_turns + ep.turns),
                    self.generate_timeout_s,
                )
            except TimeoutError:
                raise TimeoutError(
                    f"{where}, turn {ep.turns}: the rollout engine returned no completion within "
                    f"rollout.generate_timeout_s={self.generate_timeout_s:g} s"
                ) from None
            self._append_policy(ep, completion)
            try:  # the whole step_timeout_s even past the wall time: the turn is trained, so it is graded
                raw = await asyncio.wait_for(
                    call(env.step, completion.text, list(completion.response_token_ids)), lim.step_timeout_s
                )
                result = as_step_result(raw, f"{where}, turn {ep.turns}")
            except TimeoutError:
                return self._end(ep, "step_timeout")
            except Exception as err:  # the environment's own failure: the episode ends, training goes on
                return self._failed(ep, where, f"{type(err).__name__}: {err}")
            ep.turn_rewards.append((len(ep.token_ids) - 1, result.reward))
            ep.tool_calls += int(result.info.get("tool_calls", 0) or 0)
            for kind in result.info.get("tool_failures", None) or []:
                ep.tool_failures[str(kind)] = ep.tool_failures.get(str(kind), 0) + 1
            if result.done:
                return self._end(ep, "done")
            if ep.turns >= lim.max_turns:
                return self._end(ep, "max_turns")
            if not result.observation:
                return self._failed(ep, where, "step() returned no observation but done=False")
            if time.perf_counter() >= deadline:
                return self._end(ep, "timeout")
            try:
                delta = self._delta(env, ep, result.observation, where)
            except TemplateDriftError:
                raise  # agent.drift: error stops the run, as asked
            except Exception as err:  # e.g. a template that insists on alternating roles, after two tool results
                return self._failed(
                    ep, where, f"the chat template refused the conversation: {type(err).__name__}: {err}"
                )
            if len(ep.prompt_ids) + len(ep.token_ids) + len(delta) >= lim.max_total_tokens:
                return self._end(ep, "max_tokens")
            ep.messages += result.observation
            self._append_env(ep, delta)

    def _append_policy(self, ep: Episode, c: Completion) -> None:
        if ep.turns == 0:
            ep.weight_version = c.weight_version
        ids = list(c.response_token_ids)
        ep.token_ids += ids
        ep.from_policy += [True] * len(ids)
        ep.logprobs += list(c.response_logprobs)
        ep.versions += list(c.token_versions or [c.weight_version] * len(ids))
        ep.turns += 1
        ep.finish_reason = c.finish_reason
        # The conversation holds what was sampled, decoded (not the engine's text, which a stop
        # string may end inside a token), without the end-of-turn token the template adds itself:
        # the special token that stopped the turn, its last. Other special tokens are the turn's
        # own (a random policy may sample <|pad|>, before its end-of-turn token or last of a turn
        # cut at its token limit): a render without them would not be a prefix match.
        end = len(ids)
        if c.finish_reason == "stop" and end and ids[-1] in self.special_ids:
            end -= 1
        content = self.decode(ids[:end])
        ep.messages.append({"role": "assistant", "content": content})

    def _append_env(self, ep: Episode, delta: list[int]) -> None:
        version = ep.versions[-1] if ep.versions else ep.weight_version
        ep.token_ids += delta
        ep.from_policy += [False] * len(delta)
        ep.logprobs += [0.0] * len(delta)
        ep.versions += [version] * len(delta)

    def _delta(self, env: Any, ep: Episode, observation: list[Message], where: str) -> list[int]:
        """The template's tokens for ``observation`` and the next assistant header (module docstring)."""
        so_far = self.decode(ep.prompt_ids + ep.token_ids)
        fresh = self.render(ep.messages + observation, env, True)
        if fresh.startswith(so_far):
            return self.encode(fresh[len(so_far) :])
        previous = self.render(ep.messages, env, False)
        if self._ended_on_another_stop_token(ep, fresh) and fresh.startswith(previous):
            # Not drift: the turn stopped on an end token of the model other than the template's (Qwen's
            # <|endoftext|> beside <|im_end|>); the template's own turn end follows it.
            return self.encode(self._turn_end(env, ep) + fresh[len(previous) :])
        ep.drift_turns += 1
        at = next((i for i, (a, b) in enumerate(zip(so_far, fresh)) if a != b), min(len(so_far), len(fresh)))
        message = (
            f"{where}, turn {ep.turns}: the chat template is not append-only: a fresh render of the "
            f"conversation differs from the tokens so far at character {at} "
            f"(so far {so_far[max(0, at - 20) : at + 20]!r}, fresh {fresh[max(0, at - 20) : at + 20]!r})"
        )
        if self.limits.drift == "error":
            raise TemplateDriftError(message + "; agent.drift=error")
        logger.warning("%s; continuing with the fresh render's new part", message)
        new_part = fresh[len(previous) :] if fresh.startswith(previous) else self.render(observation, env, True)
        return self.encode(self._turn_end(env, ep) + new_part)

    def _ended_on_another_stop_token(self, ep: Episode, fresh: str) -> bool:
        """Whether the last turn stopped on a special token that the template does not write there: the
        fresh render then continues everything before that token, and differs only from it on."""
        if ep.finish_reason != "stop" or not ep.from_policy or not ep.from_policy[-1]:
            return False
        if ep.token_ids[-1] not in self.special_ids:
            return False
        return fresh.startswith(self.decode(ep.prompt_ids + ep.token_ids[:-1]))

    def _turn_end(self, env: Any, ep: Episode) -> str:
        """What the template writes after the last assistant turn's content (its end-of-turn), less
        the end-of-turn tokens the policy sampled itself: a drifting render's new part starts after it."""
        marker = "\x00raylign-turn-end\x00"
        closed = self.render(ep.messages[:-1] + [{"role": "assistant", "content": marker}], env, False)
        after = closed[closed.rfind(marker) + len(marker) :] if marker in closed else ""
        end = len(ep.token_ids)
        while end and ep.from_policy[end - 1] and ep.token_ids[end - 1] in self.special_ids:
            end -= 1
        sampled = self.decode(ep.token_ids[end:])  # the turn's trailing special tokens, e.g. "<|im_end|>"
        overlap = next(k for k in range(len(after), -1, -1) if sampled.endswith(after[:k]))
        return after[overlap:]

    def _check_step_budget(self, env: Any, where: str) -> None:
        """An environment's ``step_budget_s`` must fit in ``step_timeout_s``: a step that used it would be
        cut off, its turn unrewarded, in every episode that needs it."""
        budget = getattr(env, "step_budget_s", None)
        if isinstance(budget, (int, float)) and budget >= self.limits.step_timeout_s:
            raise EnvironmentFailed(
                f"{where}: {type(env).__name__}'s step_budget_s={budget:g} s is not below agent.step_timeout_s="
                f"{self.limits.step_timeout_s:g} s, which would end the episode without the turn's reward; lower "
                "agent.env_args.step_budget_s or raise agent.step_timeout_s"
            )

    @staticmethod
    def _end(ep: Episode, reason: EndReason) -> None:
        ep.end_reason = reason

    @staticmethod
    def _failed(ep: Episode, where: str, error: str) -> None:
        """An environment turn that cannot go on: the episode ends (env_error), training goes on."""
        ep.error = error
        logger.warning("%s, turn %d: the episode ends (env_error): %s", where, ep.turns, error)
        ep.end_reason = "env_error"

    async def _close(self, env: Any, where: str) -> None:
        close = getattr(env, "close", None)
        if not callable(close):
            return
        try:
            await asyncio.wait_for(call(close), self.limits.step_timeout_s)
        except Exception as err:  # the episode is over either way
            logger.warning("%s: the environment's close() failed: %r", where, err)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Per-step agent metrics: turns, tool calls and failures by kind, tokens by source, end reasons."""
    if not episodes:
        return {}
    n = len(episodes)
    turn_rewards = [r for e in episodes for _, r in e.turn_rewards]
    metrics = {
        "agent/turns_mean": sum(e.turns for e in episodes) / n,
        "agent/turns_max": float(max(e.turns for e in episodes)),
        "agent/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "agent/tool_use_fraction": sum(e.tool_calls > 0 for e in episodes) / n,
        "agent/policy_tokens_mean": sum(e.policy_tokens for e in episodes) / n,
        "agent/env_tokens_mean": sum(len(e.token_ids) - e.policy_tokens for e in episodes) / n,
        "agent/template_drift_turns": float(sum(e.drift_turns for e in episodes)),
        "agent/reward_per_turn_mean": sum(turn_rewards) / len(turn_rewards) if turn_rewards else 0.0,
        "agent/episode_seconds_mean": sum(e.seconds for e in episodes) / n,
    }
    for reason in END_REASONS:
        metrics[f"agent/end/{reason}"] = sum(e.end_reason == reason for e in episodes) / n
    kinds = sorted({k for e in episodes for k in e.tool_failures})
    metrics["agent/tool_failures"] = float(sum(sum(e.tool_failures.values()) for e in episodes))
    for kind in kinds:
        metrics[f"agent/tool_failures/{kind}"] = float(sum(e.tool_failures.get(kind, 0) for e in episodes))
    return metrics
