"""Agent episodes as the RL loop's rollouts: many in flight against the engines, taken back as each
prompt group finishes.

:class:`EpisodeStream` has the shape of :class:`raylign.rollout.pool.GroupStream` (``submit``,
``finished``, ``drain``), so the staleness-bounded :class:`~raylign.rl.stream.RolloutFeed` drives
agent runs exactly as it drives single-turn ones. A prompt group is ``sampling.n`` episodes of
one prompt, each its own environment instance, all running at once on an event loop in a
background thread; each engine request is one policy turn (``n=1``). An episode keeps to one
engine (its earlier turns are in that engine's prefix cache), the engine with the least work
outstanding when it starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raylign.agents.client import ClientEpisodeRunner
from raylign.agents.episode import Episode, EpisodeRunner
from raylign.config.rollout import SamplingConfig
from raylign.rl.experience import Sample
from raylign.rl.prompts import Prompt
from raylign.rollout.base import Completion
from raylign.rollout.pool import EngineDied, FinishedGroup, RolloutPool

log = logging.getLogger("raylign")


@dataclass
class _InFlight:
    tag: Any
    submitted: float


class EpisodeStream:
    """Prompt groups of agent episodes in flight on a pool's engines (see the module docstring)."""

    def __init__(self, pool: RolloutPool, runner: EpisodeRunner | ClientEpisodeRunner, timeout_s: float):
        """``timeout_s``: the longest wait for any group to finish (``finished``)."""
        self.pool, self.runner, self.timeout_s = pool, runner, timeout_s
        self.resubmitted = 0  # kept for the GroupStream interface: engine deaths are not recovered here
        self._pending: dict[concurrent.futures.Future, _InFlight] = {}
        self._lock = threading.Lock()  # the engines' outstanding work, counted from two event loops
        self._requests = itertools.count(2_000_000)  # endpoint requests' indices (seeds)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="raylign-episodes", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._pending)

    def tags(self) -> list[Any]:
        return [group.tag for group in self._pending.values()]

    def submit(self, prompt: Prompt, sampling: SamplingConfig, prompt_index: int, tag: Any) -> None:
        """Start the ``sampling.n`` episodes of ``prompt``; ``prompt_index`` numbers their requests (seeds)."""
        future = asyncio.run_coroutine_threadsafe(self._group(prompt, sampling, prompt_index), self._loop)
        self._pending[future] = _InFlight(tag, time.time())

    def finished(self, wait: bool = True) -> list[FinishedGroup]:
        """The groups that have finished; with ``wait``, at least one (at most ``timeout_s``)."""
        if not self._pending:
            return []
        done, _ = concurrent.futures.wait(
            list(self._pending), timeout=self.timeout_s if wait else 0, return_when=concurrent.futures.FIRST_COMPLETED
        )
        if wait and not done:
            raise TimeoutError(
                f"agent rollout: no prompt group of episodes finished within {self.timeout_s:.0f} s "
                f"({len(self._pending)} in flight); raise rollout.generate_timeout_s, or lower "
                "agent.episode_timeout_s"
            )
        out = []
        for future in done:
            group = self._pending.pop(future)
            out.append(FinishedGroup(group.tag, future.result(), -1, group.submitted, time.time()))
        return out

    def drain(self) -> list[FinishedGroup]:
        out: list[FinishedGroup] = []
        while self._pending:
            out += self.finished()
        return out

    # ---- a whole request (evaluation) ------------------------------------------------------

    def submit_all(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[concurrent.futures.Future]:
        """Start ``sampling.n`` episodes of every prompt without waiting (see :meth:`collect_all`)."""
        return [
            asyncio.run_coroutine_threadsafe(self._group(p, sampling, 1_000_000 + i), self._loop)
            for i, p in enumerate(prompts)
        ]

    @staticmethod
    def all_done(pending: list[concurrent.futures.Future]) -> bool:
        return all(f.done() for f in pending)

    def collect_all(self, pending: list[concurrent.futures.Future]) -> list[list[Episode]]:
        done, waiting = concurrent.futures.wait(pending, timeout=self.timeout_s)
        if waiting:
            raise TimeoutError(
                f"agent evaluation: {len(waiting)} of {len(pending)} prompt groups did not finish within "
                f"{self.timeout_s:.0f} s; raise rollout.generate_timeout_s"
            )
        return [f.result() for f in pending]

    # ---- on the event loop -----------------------------------------------------------------

    async def _group(self, prompt: Prompt, sampling: SamplingConfig, prompt_index: int) -> list[Episode]:
        where = f"training prompt {prompt.where}"
        return list(
            await asyncio.gather(
                *(
                    self._episode(prompt, sampling, prompt_index * sampling.n + j, f"{where}, episode {j}")
                    for j in range(sampling.n)
                )
            )
        )

    async def _episode(self, prompt: Prompt, sampling: SamplingConfig, index: int, where: str) -> Episode:
        load = self.runner.limits.max_total_tokens
        engine = self._take(load)

        async def generate(ids: list[int], turn: SamplingConfig, request: int) -> Completion:
            return await self._complete(engine, ids, turn, request, where)

        try:
            return await self.runner.run(
                prompt.raw, prompt.label, prompt.metadata, generate, sampling, request_index=index, where=where
            )
        finally:
            self._give_back(engine, load)

    async def complete(self, ids: list[int], sampling: SamplingConfig) -> Completion:
        """One completion on the engine with the least work outstanding, from any event loop (the
        endpoint's requests)."""
        load = len(ids) + sampling.max_new_tokens
        engine = self._take(load)
        request = self._complete(engine, ids, sampling, next(self._requests), "an endpoint request")
        try:
            return await asyncio.wait_for(request, self.timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"rollout engine {engine} did not answer an endpoint request within {self.timeout_s:.0f} s; "
                "raise rollout.generate_timeout_s"
            ) from None
        finally:
            self._give_back(engine, load)

    def _take(self, load: int) -> int:
        with self._lock:
            engine = min(range(len(self.pool.engines)), key=lambda e: (self.pool.outstanding[e], e))
            self.pool.outstanding[engine] += load
            return engine

    def _give_back(self, engine: int, load: int) -> None:
        with self._lock:
            self.pool.outstanding[engine] -= load

    async def _complete(self, engine: int, ids: list[int], sampling: SamplingConfig, request: int, where: str):
        import ray

        try:
            (completion,) = await self.pool.engines[engine].generate_group.remote(ids, sampling, request)
        except ray.exceptions.RayActorError as err:
            raise EngineDied(f"rollout engine {engine} died during an agent episode ({where})", [engine]) from err
        return completion

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel the episodes still running (their environments are closed), then stop the loop."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            # An environment that ignores cancellation: the daemon thread goes with the process.
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                log.warning(
                    "agent episodes: %d still running %g s after they were cancelled (an environment that "
                    "ignores cancellation?); they end with this process",
                    len(self._pending),
                    timeout_s,
                )
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.warning(
                    "agent episodes: their event loop did not stop within %g s; it ends with this process", timeout_s
                )
        self._pending.clear()


def sample_from_episode(ep: Episode, prompt: Prompt, tokenizer: Any) -> Sample:
    """The sample an episode makes: the prompt, then every token after it; environment tokens masked."""
    return Sample(
        ep.prompt_ids,
        ep.token_ids,
        ep.logprobs,
        tokenizer.decode(ep.prompt_ids, skip_special_tokens=False),
        ep.messages[-1]["content"] if ep.messages and ep.messages[-1]["role"] == "assistant" else "",
        prompt.label,
        prompt.source,
        ep.finish_reason,
        reward=ep.reward,
        weight_version=ep.weight_version,
        token_versions=list(ep.versions),
        loss_mask=[int(p) for p in ep.from_policy],
        turn_rewards=list(ep.turn_rewards),
        episode=ep,
    )


def check_agent_code(agent: Any) -> None:
    """Before anything starts: ``agent.env`` (or ``agent.client``) imports and names what it must, and the
    environment class takes ``agent.env_args``; found otherwise only at the first episode, after the workers
    and engines have started, as a TypeError naming neither setting. ValueError naming the setting."""
    from raylign.agents.env import load_callable, load_environment

    if agent.client is not None:
        _as_setting_error(load_callable, agent.client, "agent.client")
        return
    if agent.env is None:
        return
    env_class = _as_setting_error(load_environment, agent.env)
    try:
        signature = inspect.signature(env_class)
    except (TypeError, ValueError):  # a class whose signature Python cannot read: its first episode will tell
        return
    try:
        signature.bind(**agent.env_args)
    except TypeError as err:
        takes = ", ".join(name for name in signature.parameters if name not in ("args", "kwargs")) or "none"
        raise ValueError(
            f"agent.env_args: {env_class.__name__} does not take them ({err}); its arguments: {takes}"
        ) from None


def _as_setting_error(load: Any, *args: Any) -> Any:
    try:
        return load(*args)
    except (AttributeError, TypeError) as err:  # these name the setting already, but are no user-facing error
        raise ValueError(str(err)) from None


def agent_episode_stream(cfg: Any, pool: RolloutPool, tokenizer: Any) -> tuple[EpisodeStream, Any]:
    """The episode stream of an agent run (``cfg`` an RLConfig with ``agent`` enabled) and, for
    ``agent.client``, the OpenAI-compatible endpoint it serves its client through (None for
    ``agent.env``, whose environments run in this process)."""
    from raylign.agents.endpoint import EndpointServer, EpisodeRecorder, build_app
    from raylign.agents.env import load_callable, load_environment
    from raylign.agents.episode import EpisodeLimits

    g, timeout = cfg.agent, cfg.rollout.generate_timeout_s
    limits = EpisodeLimits(g.max_turns, g.max_total_tokens, g.episode_timeout_s, g.step_timeout_s, g.drift)
    if g.env is not None:
        env_class, env_args = load_environment(g.env), dict(g.env_args)
        runner = EpisodeRunner(lambda: env_class(**env_args), tokenizer, limits, timeout)
        return EpisodeStream(pool, runner, timeout), None
    recorder = EpisodeRecorder()
    client = ClientEpisodeRunner(load_callable(g.client, "agent.client"), recorder, "", g.api_key or "none", limits)
    stream = EpisodeStream(pool, client, timeout)
    app = build_app(stream.complete, tokenizer, recorder, api_key=g.api_key)
    endpoint = EndpointServer(app, g.endpoint_host, g.endpoint_port).start()
    client.base_url = endpoint.url
    log.info("OpenAI-compatible endpoint for agent.client: %s", endpoint.url)
    return stream, endpoint
