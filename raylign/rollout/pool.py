"""A pool of engine actors behind one generate call, and a stream of prompt groups over it.

A whole request (:meth:`RolloutPool.generate`): the pool splits its prompts across the
engines so that each gets about the same number of tokens to process (prompt plus
``max_new_tokens``, times ``n``; the ``n`` samples of a prompt stay on one engine, where
they share the prompt's KV blocks), runs the shards concurrently and returns every
completion in prompt order, samples in order within a prompt.

A stream (:class:`GroupStream`): prompt groups are submitted one at a time, each to the
engine with the least work outstanding, and taken back as each one finishes. When an
engine's process dies, the stream hands the dead engines to its owner's ``restart``
(which replaces them) and submits their groups again; without one it raises, naming them.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.rollout.base import Completion, RolloutEngine, default_prompt_indices
from raylign.rollout.weight_sync import SyncStats, WeightSyncSender

logger = logging.getLogger(__name__)


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine class behind ``rollout.engine``: a built-in one (vllm, hf), or the
    :class:`RolloutEngine` subclass ``path/to/file.py:Class`` or ``package.module:Class`` names."""
    if name == "vllm":
        from raylign.rollout.vllm_engine import VLLMEngine

        return VLLMEngine
    if name == "hf":
        from raylign.rollout.hf_engine import HFEngine

        return HFEngine
    if ":" not in name:
        raise ValueError(
            f"rollout.engine: unknown engine {name!r}; allowed: 'vllm', 'hf', 'path/to/file.py:Class' "
            "or 'package.module:Class'"
        )
    return user_engine_class(name)


def user_engine_class(spec: str) -> type[RolloutEngine]:
    """The engine class of the user's own that ``spec`` names, checked to be a concrete RolloutEngine.

    A class from a file loaded by path lives in a module that no other process can import, so it is
    registered to travel by value: Ray then ships its code, not its module's name, to the engine actors
    (on any node, whether or not the file is there)."""
    import ray.cloudpickle

    from raylign.user_code import load_callable, loaded_from_file

    cls = load_callable(spec, "rollout.engine")
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        what = f"class {cls.__name__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise TypeError(
            f"rollout.engine: {spec} names {what}, which is not a subclass of raylign.rollout.base.RolloutEngine"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"rollout.engine: {spec} does not implement RolloutEngine's abstract methods {missing}")
    if loaded_from_file(cls):
        ray.cloudpickle.register_pickle_by_value(sys.modules[cls.__module__])
    return cls


def launch_engines(
    model_path: str | Path,
    config: RolloutConfig,
    env_vars: dict[str, str] | None = None,
    startup_timeout_s: float = 600.0,
    timeout_setting: str = "placement.startup_timeout_s",
    lora_rank: int = 0,
) -> list[Any]:
    """Start ``config.num_engines`` engine actors (one Ray actor each) and wait until they are loaded.

    On a cluster with GPUs each vLLM engine actor reserves ``tensor_parallel_size`` GPUs.
    ``env_vars`` are added to the actors' environment (for example ``OMP_NUM_THREADS``). An engine
    that fails to load, or is not loaded within ``startup_timeout_s``, raises
    :class:`raylign.cluster.StartupError` naming it. ``lora_rank > 0``: the engines serve LoRA
    adapters of that rank (``rollout.lora_sync: adapter``).
    """
    import ray

    from raylign.cluster import actor_env, wait_until_ready

    cls = engine_class(config.engine)
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    actor_cls = ray.remote(cls).options(
        num_cpus=config.num_cpus_per_engine,
        num_gpus=config.tensor_parallel_size if has_gpus else 0,
        runtime_env={"env_vars": actor_env(env_vars)},
    )
    engines = [actor_cls.remote(str(model_path), config.model_dump(), lora_rank) for _ in range(config.num_engines)]
    names = [f"rollout engine {i} ({config.engine}, model {model_path})" for i in range(len(engines))]
    try:
        # An engine answers its first call once its model is loaded.
        wait_until_ready(
            dict(zip(names, engines)),
            startup_timeout_s,
            timeout_setting,
            ready={name: e.weight_version_now.remote() for name, e in zip(names, engines)},
        )
    except Exception:
        for engine in engines:
            ray.kill(engine)
        raise
    return engines


def stop_engines(engines: Sequence[Any], timeout_s: float = 60.0) -> None:
    """Let each engine stop what it started (vLLM's engine-core process), then kill the actors."""
    import ray

    try:
        ray.get([engine.shutdown.remote() for engine in engines], timeout=timeout_s)
    except Exception as err:  # the actors are killed below either way
        logger.warning("rollout engines did not shut down cleanly within %.0f s: %s", timeout_s, err)
    for engine in engines:
        ray.kill(engine)


def split_by_token_load(prompt_lengths: Sequence[int], num_engines: int, max_new_tokens: int) -> list[list[int]]:
    """Assign prompt positions to engines, balancing the sum of ``prompt_length + max_new_tokens``.

    Longest-processing-time-first: the heaviest remaining prompt goes to the engine with
    the smallest load so far (ties to the lower engine index). Positions come back sorted
    within each engine.
    """
    if num_engines < 1:
        raise ValueError(f"need at least one engine, got {num_engines}")
    heap = [(0, engine) for engine in range(num_engines)]
    shards: list[list[int]] = [[] for _ in range(num_engines)]
    order = sorted(range(len(prompt_lengths)), key=lambda i: (-prompt_lengths[i], i))
    for position in order:
        load, engine = heapq.heappop(heap)
        shards[engine].append(position)
        heapq.heappush(heap, (load + prompt_lengths[position] + max_new_tokens, engine))
    return [sorted(shard) for shard in shards]


def order_completions(completions: Iterable[Completion], prompt_indices: Sequence[int], n: int) -> list[Completion]:
    """Completions sorted by (prompt position in the request, sample); checks each is there exactly once."""
    position = {index: pos for pos, index in enumerate(prompt_indices)}
    ordered = sorted(completions, key=lambda c: (position[c.prompt_index], c.sample_index))
    expected = [(index, sample) for index in prompt_indices for sample in range(n)]
    got = [(c.prompt_index, c.sample_index) for c in ordered]
    if got != expected:
        missing = sorted(set(expected) - set(got))[:5]
        raise RuntimeError(
            f"rollout pool: engines returned {len(got)} completions, expected {len(expected)}; "
            f"missing (prompt, sample) e.g. {missing}"
        )
    return ordered


@dataclass
class PendingRollout:
    """A generate request in flight on the pool's engines (from :meth:`RolloutPool.submit`)."""

    refs: list[Any]
    prompt_indices: list[int]
    n: int


class RolloutPool:
    """Engine actors behind one ``generate``; also fans out weight syncs and cache resets."""

    def __init__(self, engines: Sequence[Any], timeout_s: float = 1800.0):
        """``timeout_s``: the longest wait for a whole request (:meth:`collect`) and for the engines'
        other calls (sleep, wake-up, cache reset)."""
        if not engines:
            raise ValueError("a rollout pool needs at least one engine")
        self.engines = list(engines)
        self.timeout_s = timeout_s
        self._sender: WeightSyncSender | None = None
        self.outstanding = [0] * len(self.engines)  # tokens of work in flight per engine (streamed groups)
        self._group_load: dict[Any, tuple[int, int]] = {}

    async def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingConfig,
        prompt_indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        """``sampling.n`` completions per prompt from all engines, in prompt order then sample order."""
        pending = self.submit(prompt_token_ids, sampling, prompt_indices)
        try:
            results = await asyncio.wait_for(asyncio.gather(*pending.refs), timeout=self.timeout_s)
        except TimeoutError:
            raise self._request_timeout(pending) from None
        return order_completions((c for result in results for c in result), pending.prompt_indices, pending.n)

    def generate_blocking(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, prompt_indices: Sequence[int] | None = None
    ) -> list[Completion]:
        """:meth:`generate` for callers outside an event loop."""
        return self.collect(self.submit(prompt_token_ids, sampling, prompt_indices))

    def submit(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, prompt_indices: Sequence[int] | None = None
    ) -> PendingRollout:
        """Start generating without waiting (the engines work while the caller goes on); see :meth:`collect`."""
        indices = default_prompt_indices(prompt_token_ids, prompt_indices)
        shards = split_by_token_load([len(p) for p in prompt_token_ids], len(self.engines), sampling.max_new_tokens)
        refs = [
            engine.generate.remote([prompt_token_ids[p] for p in shard], sampling, [indices[p] for p in shard])
            for engine, shard in zip(self.engines, shards)
            if shard
        ]
        return PendingRollout(refs, list(indices), sampling.n)

    def is_done(self, pending: PendingRollout) -> bool:
        import ray

        ready, _ = ray.wait(pending.refs, num_returns=len(pending.refs), timeout=0)
        return len(ready) == len(pending.refs)

    def collect(self, pending: PendingRollout) -> list[Completion]:
        """Wait for a submitted request: its completions in prompt order, then sample order."""
        import ray

        try:
            results = ray.get(pending.refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self._request_timeout(pending) from None
        return order_completions((c for result in results for c in result), pending.prompt_indices, pending.n)

    def _request_timeout(self, pending: PendingRollout) -> TimeoutError:
        return TimeoutError(
            f"rollout: a request of {len(pending.prompt_indices)} prompts did not finish within "
            f"{self.timeout_s:.0f} s on {len(self.engines)} engine(s); raise "
            "rollout.generate_timeout_s if generation is this slow"
        )

    def submit_group(self, prompt_token_ids: list[int], sampling: SamplingConfig, prompt_index: int) -> tuple[Any, int]:
        """Start one prompt group on the engine with the least outstanding work: ``(ref, engine)``.

        Work is counted in tokens, ``(prompt + max_new_tokens) * n``, until :meth:`group_done`."""
        load = (len(prompt_token_ids) + sampling.max_new_tokens) * sampling.n
        engine = min(range(len(self.engines)), key=lambda e: (self.outstanding[e], e))
        self.outstanding[engine] += load
        ref = self.engines[engine].generate_group.remote(list(prompt_token_ids), sampling, prompt_index)
        self._group_load[ref] = (engine, load)
        return ref, engine

    def group_done(self, ref: Any) -> None:
        engine, load = self._group_load.pop(ref)
        self.outstanding[engine] -= load

    def dead_engines(self, timeout_s: float = 60.0) -> list[int]:
        """The engines whose actor has died (each is asked for its weight version)."""
        import ray

        refs = [engine.weight_version_now.remote() for engine in self.engines]
        dead = []
        for index, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayActorError:
                dead.append(index)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"rollout engine {index} did not say its weight version within {timeout_s:.0f} s (alive but stuck?)"
                ) from None
        return dead

    def replace_engine(self, index: int, engine: Any) -> None:
        """Put a new engine actor in the place of engine ``index`` (which died)."""
        self.engines[index] = engine

    def connect_weight_sync(self, bucket_mb: float = 32.0, timeout_s: float = 600.0, host: str | None = None) -> None:
        """Open the sync groups to every engine (call on the trainer rank that holds full weights)."""
        self._sender = WeightSyncSender(self.engines, bucket_mb=bucket_mb, timeout_s=timeout_s, host=host)
        self._sender.connect()

    def reconnect_weight_sync(self, replaced: dict[int, Any]) -> None:
        """Engines ``index -> new actor`` took the place of dead ones: open their sync groups."""
        if self._sender is None:
            raise RuntimeError("RolloutPool.reconnect_weight_sync() before connect_weight_sync()")
        for index, engine in replaced.items():
            self.engines[index] = engine
            self._sender.replace(index, engine)

    def sync_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        keep_running: bool = False,
        version: int | None = None,
        only: Sequence[int] | None = None,
        adapter: dict[str, Any] | None = None,
    ) -> SyncStats:
        """Send full weights to every engine, or to the engines ``only`` (labelled ``version``); they
        reset their prefix caches afterwards. With ``adapter`` (a PEFT adapter config) the tensors are
        LoRA adapter weights, served as a new adapter (:meth:`RolloutEngine.receive_adapter`)."""
        if self._sender is None:
            raise RuntimeError("RolloutPool.sync_weights() before connect_weight_sync()")
        return self._sender.sync(named_tensors, keep_running, version, only, adapter)

    def close_weight_sync(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        return self._answers(method, [getattr(engine, method).remote(*args) for engine in self.engines])

    def _answers(self, method: str, refs: list[Any]) -> list[Any]:
        """Every engine's answer to its call of ``method`` (``refs``, in engine order), within the timeout."""
        from raylign.cluster import get_within

        return get_within(
            refs,
            self.timeout_s,
            f"rollout engines' {method}",
            "rollout.generate_timeout_s",
            [f"engine {i}" for i in range(len(self.engines))],
        )

    def reset_prefix_cache(self) -> None:
        self._call_all("reset_prefix_cache")

    def score(self, token_ids: list[int]) -> list[Any]:
        """Every engine's :class:`~raylign.rollout.base.TokenScores` of one token sequence, in engine order."""
        return self.scores(self.submit_score(token_ids))

    def submit_score(self, token_ids: list[int], base: bool = False) -> list[Any]:
        """Start every engine scoring ``token_ids`` (``base``: without its LoRA adapter) without
        waiting; :meth:`scores` collects them."""
        return [engine.score.remote(list(token_ids), base) for engine in self.engines]

    def scores(self, submitted: list[Any]) -> list[Any]:
        return self._answers("score", submitted)

    def sleep(self, level: int = 1) -> None:
        self._call_all("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call_all("wake_up", tags)


@dataclass
class FinishedGroup:
    """One prompt group back from the stream: what the caller tagged it with, its completions,
    the engine that made it, when it was submitted and when it came back (``time.time()``, the clock
    of the completions' own ``finished_at``)."""

    tag: Any
    completions: list[Completion]
    engine: int
    submitted_at: float
    finished_at: float


class EngineDied(RuntimeError):
    """A rollout engine's process died and nothing could restart it; ``engines`` are their indices."""

    def __init__(self, message: str, engines: list[int]):
        super().__init__(message)
        self.engines = engines


@dataclass
class _InFlight:
    tag: Any
    engine: int
    submitted: float
    request: tuple[list[int], SamplingConfig, int]  # what to submit again if the engine dies


class GroupStream:
    """Prompt groups in flight on a pool's engines, taken back in the order they finish."""

    def __init__(
        self,
        pool: RolloutPool,
        timeout_s: float,
        timeout_setting: str = "rollout.generate_timeout_s",
        restart: Callable[[list[int]], None] | None = None,
    ):
        """``restart(dead)``: replace the dead engines (by index) in the pool; their groups are then
        submitted again. Without it a dead engine raises :class:`EngineDied`."""
        self.pool = pool
        self.timeout_s = timeout_s
        self.timeout_setting = timeout_setting
        self.restart = restart
        self.resubmitted = 0  # groups submitted again after their engine died
        self._pending: dict[Any, _InFlight] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def tags(self) -> list[Any]:
        """Tags of the groups in flight, in submission order."""
        return [group.tag for group in self._pending.values()]

    def submit(self, prompt_token_ids: list[int], sampling: SamplingConfig, prompt_index: int, tag: Any) -> None:
        ref, engine = self.pool.submit_group(prompt_token_ids, sampling, prompt_index)
        self._pending[ref] = _InFlight(tag, engine, time.time(), (list(prompt_token_ids), sampling, prompt_index))

    def finished(self, wait: bool = True) -> list[FinishedGroup]:
        """The groups that have finished; with ``wait``, blocks until at least one has (at most
        ``timeout_s``, then a TimeoutError naming the groups in flight and their engines)."""
        import ray

        if not self._pending:
            return []
        refs = list(self._pending)
        ready, _ = ray.wait(refs, num_returns=1, timeout=self.timeout_s if wait else 0)
        if wait and not ready:
            engines = sorted({group.engine for group in self._pending.values()})
            raise TimeoutError(
                f"rollout: no prompt group finished within {self.timeout_s:.0f} s "
                f"({len(refs)} in flight on engine(s) {engines}); raise {self.timeout_setting} "
                "if generation is this slow, or check the engines' logs"
            )
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)  # everything else already done too
        out, dead = [], {}
        for ref in ready:
            group = self._pending[ref]
            try:
                completions = ray.get(ref, timeout=self.timeout_s)
            except ray.exceptions.RayActorError as err:
                dead.setdefault(group.engine, err)
                continue
            del self._pending[ref]
            self.pool.group_done(ref)
            out.append(FinishedGroup(group.tag, completions, group.engine, group.submitted, time.time()))
        if dead:
            self._recover(dead)
        return out

    def _recover(self, dead: dict[int, Exception]) -> None:
        """Engines died: every group they had is lost. Restart them, then submit those groups again."""
        from raylign.cluster import death_cause

        if self.restart is None:
            engine, err = next(iter(sorted(dead.items())))
            raise EngineDied(
                f"rollout engine {engine} died ({death_cause(err)}) with "
                f"{sum(g.engine in dead for g in self._pending.values())} prompt group(s) in flight",
                sorted(dead),
            )
        lost = {ref: group for ref, group in self._pending.items() if group.engine in dead}
        for ref in lost:
            del self._pending[ref]
            self.pool.group_done(ref)
        self.restart(sorted(dead))
        for group in lost.values():
            self.submit(*group.request, tag=group.tag)
        self.resubmitted += len(lost)

    def drain(self) -> list[FinishedGroup]:
        """Wait for every group in flight."""
        out: list[FinishedGroup] = []
        while self._pending:
            out += self.finished()
        return out
