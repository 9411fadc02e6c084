"""Episodes played by an agent written against an OpenAI client, through the endpoint.

The user writes one function (sync or async) and points ``agent.client: path/to/agent.py:run``
at it::

    def run(ctx):
        client = ctx.openai_client()          # base_url, key and session id already set
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": ctx.prompt}])
        ...
        return reward                          # a number (numpy's too), or None and POST /v1/sessions/{id}/reward

It is called once per episode. Every request it makes is sampled by the rollout engines and
recorded into the episode (:class:`raylign.agents.endpoint.EpisodeRecorder`); when it returns,
the recorded turns become one token sequence, as in :mod:`raylign.agents.episode`: each turn's
prompt must begin with everything before it (the endpoint sees to that while the client sends
back the conversation it was given), and the tokens in between are the environment's, masked. A
turn's last tokens that the next prompt leaves out (a stop string, which the returned text does not
hold) are dropped. A turn whose prompt does not continue the episode otherwise (the client rewrote
the history) ends the sequence there and counts as a drift turn. The reward, returned or posted, goes on the last
policy token.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from raylign.agents.endpoint import EpisodeRecorder, Turn
from raylign.agents.env import as_number, call
from raylign.agents.episode import EnvironmentFailed, Episode, EpisodeLimits, TemplateDriftError

logger = logging.getLogger(__name__)


@dataclass
class AgentContext:
    """What an agent function gets for one episode."""

    base_url: str
    api_key: str
    session_id: str
    prompt: Any
    label: Any
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Session-Id": self.session_id}

    def openai_client(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client whose requests are recorded into this episode."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, default_headers=self.headers, **kwargs)

    def async_openai_client(self, **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, default_headers=self.headers, **kwargs)


class ClientEpisodeRunner:
    """Plays episodes by calling ``agent_fn(ctx)``; has the interface of
    :class:`raylign.agents.episode.EpisodeRunner` (``run``, ``limits``)."""

    def __init__(self, agent_fn: Any, recorder: EpisodeRecorder, base_url: str, api_key: str, limits: EpisodeLimits):
        self.agent_fn, self.recorder, self.base_url, self.api_key = agent_fn, recorder, base_url, api_key
        self.limits = limits

    async def run(
        self,
        prompt: Any,
        label: Any,
        metadata: dict[str, Any],
        generate: Any = None,  # unused: the agent's requests reach the engines through the endpoint
        sampling: Any = None,
        request_index: int = 0,
        where: str = "episode",
    ) -> Episode:
        session = f"episode-{request_index}-{uuid.uuid4().hex[:8]}"
        ctx = AgentContext(self.base_url, self.api_key, session, prompt, label, dict(metadata))
        start = time.perf_counter()
        reason, error, returned = "done", None, None
        try:
            returned = await asyncio.wait_for(call(self.agent_fn, ctx), self.limits.episode_timeout_s)
        except TimeoutError:
            reason = "timeout"
        except Exception as err:  # the agent's own failure: the episode ends with what it recorded
            reason, error = "env_error", f"{type(err).__name__}: {err}"
            logger.warning("%s: the agent function raised %s", where, error)
        try:
            recorded = self.recorder.close(session)
            turns, posted = recorded.turns, recorded.reward
        except KeyError:
            turns, posted = [], None
        if not turns:
            raise EnvironmentFailed(
                f"{where}: the agent function made no request to the endpoint "
                f"({reason}{': ' + error if error else ''}); nothing to train on"
            )
        if returned is None:
            reward = float(posted or 0.0)
        else:
            name = getattr(self.agent_fn, "__qualname__", type(self.agent_fn).__name__)
            reward = as_number(returned, f"{where}: the agent function {name} returned")
        ep = episode_from_turns(turns, reward, self.limits, where)
        if ep.end_reason == "done":
            ep.end_reason = reason  # type: ignore[assignment]
        ep.error = error
        ep.seconds = time.perf_counter() - start
        ep.finished_at = time.time()
        return ep


def _unseen_tail(so_far: list[int], prompt: list[int], hidden: int) -> int:
    """How many of the last response's final tokens ``prompt`` leaves out while continuing all before
    them, at most the ``hidden`` ones the client never saw (:attr:`Turn.hidden_tail`): 0 when it
    continues all of ``so_far``, or leaves out more (drift). A stop string ends the text the endpoint
    returns (as OpenAI's API does) but not the tokens sampled, so the next request goes on from before it."""
    for unseen in range(min(hidden, len(so_far)) + 1):
        kept = len(so_far) - unseen
        if prompt[:kept] == so_far[:kept]:
            return unseen
    return 0


def episode_from_turns(turns: list[Turn], reward: float, limits: EpisodeLimits, where: str = "episode") -> Episode:
    """One token sequence from a session's turns (module docstring); ``reward`` on the last policy token."""
    first = turns[0]
    ep = Episode(list(first.prompt_token_ids), weight_version=first.weight_version)
    for k, turn in enumerate(turns):
        so_far = ep.prompt_ids + ep.token_ids
        delta: list[int] = []
        if k > 0:
            unseen = _unseen_tail(so_far, turn.prompt_token_ids, turns[k - 1].hidden_tail)
            if unseen:  # the client never saw them (a stop string the endpoint cut from its text): not trained
                so_far = so_far[:-unseen]
                for sequence in (ep.token_ids, ep.from_policy, ep.logprobs, ep.versions):
                    del sequence[-unseen:]
            if turn.prompt_token_ids[: len(so_far)] != so_far:
                ep.drift_turns += 1
                message = f"{where}, turn {k + 1}: its prompt does not continue the tokens of the turns before it"
                if limits.drift == "error":
                    raise TemplateDriftError(message + "; agent.drift=error")
                logger.warning("%s; the episode is trained up to turn %d", message, k)
                break
            delta = list(turn.prompt_token_ids[len(so_far) :])
        if k >= limits.max_turns:
            ep.end_reason = "max_turns"
            break
        response, logprobs = list(turn.response_token_ids), list(turn.response_logprobs)
        versions = list(turn.token_versions or [turn.weight_version] * len(response))
        room = limits.max_total_tokens - len(so_far) - len(delta)
        cut = len(response) > room
        if cut:
            ep.end_reason = "max_tokens"
            if k > 0 or room <= 0:
                break
            # The first turn alone is too long (the endpoint does not know the limit): its first tokens,
            # as sampled, are the episode rather than nothing.
            response, logprobs, versions = response[:room], logprobs[:room], versions[:room]
        version = ep.versions[-1] if ep.versions else turn.weight_version
        ep.token_ids += delta + response
        ep.from_policy += [False] * len(delta) + [True] * len(response)
        ep.logprobs += [0.0] * len(delta) + logprobs
        ep.versions += [version] * len(delta) + versions
        ep.turns += 1
        ep.finish_reason = "length" if cut else turn.finish_reason
        ep.messages.append({"role": "assistant", "content": turn.text})
        if cut:
            break
    if ep.turns == 0:
        raise EnvironmentFailed(
            f"{where}: the first request's prompt alone ({len(first.prompt_token_ids)} tokens) fills "
            f"agent.max_total_tokens ({limits.max_total_tokens})"
        )
    last = max(i for i, p in enumerate(ep.from_policy) if p)
    ep.turn_rewards = [(last, reward)]
    return ep
