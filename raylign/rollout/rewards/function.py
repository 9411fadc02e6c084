"""Rewards from a user's Python file, computed in a pool of worker processes.

The file defines a batched function (default name ``reward_func``)::

    def reward_func(prompts, responses, labels, **metadata):
        return [float(...) for ...]                           # one reward per sample
        # or {"rewards": [...], "my_metric": [...], ...}     # extra per-sample metrics

Each metadata key arrives as a list with one value per sample (``None`` where a sample lacks
the key); a function without ``**metadata`` gets only the keys it names as parameters.

The batch is split into ``num_workers`` contiguous chunks, one call per chunk, each in its own
spawned process, so a slow or crashing function cannot stall or kill the trainer. A call that
outlives ``timeout_s`` stops the workers (they restart on the next batch) and raises.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import weakref
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from raylign.rollout.rewards.base import (
    REWARD_ARGUMENTS,
    RewardError,
    RewardResult,
    RewardSource,
    concatenate_results,
    describe_batch,
    to_float_list,
)
from raylign.rollout.rewards.function_worker import call_reward_function, check_loadable, ignore_interrupts

# The most common reason a worker dies at start: a script that builds the source at import time
# (spawned workers import the main module again, and would start workers of their own).
_MAIN_GUARD_HINT = (
    ' (if a script of yours creates this reward source, create it under `if __name__ == "__main__":`: '
    "the worker processes import the script again)"
)

log = logging.getLogger("raylign")


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) ranges cutting ``count`` items into at most ``parts`` contiguous, near-equal chunks."""
    parts = max(1, min(parts, count))
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def metadata_to_columns(metadata: list[dict]) -> dict[str, list[Any]]:
    """[{'a': 1}, {'a': 2, 'b': 3}] -> {'a': [1, 2], 'b': [None, 3]} (keys in first-seen order)."""
    keys: dict[str, None] = {}
    for row in metadata:
        keys.update(dict.fromkeys(row))
    clash = [k for k in keys if k in REWARD_ARGUMENTS]
    if clash:
        raise ValueError(f"metadata keys {clash} clash with the reward function's positional arguments")
    return {k: [row.get(k) for row in metadata] for k in keys}


def _stop_pool(executor: ProcessPoolExecutor) -> None:
    """Kill the workers (a hung user function ignores everything else) and drop the pool."""
    kill_workers = getattr(executor, "kill_workers", None)  # Python >= 3.14
    if kill_workers is not None:
        kill_workers()
        return
    # Before 3.14 the pool offers no way to stop a running task, so its process table is used.
    processes = list((getattr(executor, "_processes", None) or {}).values())
    for process in processes:
        process.kill()
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            log.warning("reward function: worker process %s did not end within 5 s of being killed", process.pid)


class _WorkerDied(Exception):
    """A worker process of the pool died while scoring ``where``."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


class PythonFileReward(RewardSource):
    """Rewards from ``function_name`` in the Python file ``path``, run in ``num_workers`` processes."""

    def __init__(
        self,
        path: str | Path,
        function_name: str = "reward_func",
        num_workers: int = 1,
        timeout_s: float = 60.0,
        startup_timeout_s: float = 300.0,
    ):
        self.path = Path(path).expanduser().resolve()
        if not self.path.is_file():
            raise FileNotFoundError(f"reward file {path} does not exist")
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"num_workers must be >= 1 and timeout_s > 0, got {num_workers} and {timeout_s}")
        self.function_name = function_name
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.description = f"reward function '{function_name}' in {self.path}"
        self._executor: ProcessPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None
        self._start_pool()

    def _start_pool(self) -> None:
        """Spawn the workers and import the file in each, so start-up never counts against ``timeout_s``."""
        executor = ProcessPoolExecutor(
            self.num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=ignore_interrupts
        )
        self._executor = executor
        self._finalizer = weakref.finalize(self, _stop_pool, executor)
        probes = [executor.submit(check_loadable, str(self.path), self.function_name) for _ in range(self.num_workers)]
        try:
            errors = [probe.result(timeout=self.startup_timeout_s) for probe in probes]
        except TimeoutError:
            self.close()
            raise RewardError(f"{self.description}: importing the file took over {self.startup_timeout_s} s") from None
        except BrokenProcessPool as err:
            self.close()
            raise RewardError(
                f"{self.description}: a worker process died while importing the file: {err}{_MAIN_GUARD_HINT}"
            ) from None
        failures = [e for e in errors if e is not None]
        if failures:
            self.close()
            raise ValueError(failures[0])

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_pool once
        self._executor = None
        self._finalizer = None

    def _submit_chunks(
        self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]
    ) -> list[tuple[int, int, Future]]:
        assert self._executor is not None
        columns = metadata_to_columns(metadata)
        chunks = []
        for start, end in split_evenly(len(prompts), self.num_workers):
            chunk_columns = {k: v[start:end] for k, v in columns.items()}
            future = self._executor.submit(
                call_reward_function,
                str(self.path),
                self.function_name,
                prompts[start:end],
                responses[start:end],
                labels[start:end],
                chunk_columns,
            )
            chunks.append((start, end, future))
        return chunks

    def _score(self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]) -> RewardResult:
        """Scores the batch; a worker that dies (killed, out of memory) is restarted and the batch
        scored again, once: a batch that kills a worker twice is an error."""
        for attempt in (1, 2):
            if self._executor is None:
                self._start_pool()
            try:
                return self._score_once(prompts, responses, labels, metadata)
            except _WorkerDied as died:
                if attempt == 2:
                    raise RewardError(
                        f"{self.description}: a worker process died (killed, out of memory or "
                        f"os._exit) on {died.where}, again after a restart"
                    ) from None
                self.restarts += 1
                log.warning(
                    "%s: a worker process died on %s; restarting the workers and scoring the batch again "
                    "(%d restart(s) so far)",
                    self.description,
                    died.where,
                    self.restarts,
                )
        raise AssertionError("unreachable")

    def _score_once(
        self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]
    ) -> RewardResult:
        try:
            chunks = self._submit_chunks(prompts, responses, labels, metadata)
        except BrokenProcessPool:  # a worker died on an earlier chunk before the later ones went in
            self.close()
            raise _WorkerDied(describe_batch(prompts, 0)) from None
        deadline = time.monotonic() + self.timeout_s
        results = []
        for start, end, future in chunks:
            where = describe_batch(prompts[start:end], start)
            payload = self._wait(future, deadline, where)
            results.append(self._chunk_result(payload, prompts[start:end], start, where))
        return concatenate_results(results, self.description)

    def _wait(self, future: Future, deadline: float, where: str) -> Any:
        """The function's return value for one chunk; RewardError on an exception, a timeout or a dead worker."""
        try:
            status, payload = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self.close()
            raise RewardError(
                f"{self.description} did not return within timeout_s={self.timeout_s} s on {where}; "
                "its worker processes were stopped (they restart on the next batch)"
            ) from None
        except BrokenProcessPool:
            self.close()
            raise _WorkerDied(where) from None
        except Exception as err:  # e.g. a return value that cannot be pickled back
            raise RewardError(f"{self.description} failed on {where}: {type(err).__name__}: {err}") from None
        if status == "error":
            cause, trace = payload
            raise RewardError(f"{self.description} failed on {where}: {cause}" + (f"\n{trace}" if trace else ""))
        return payload

    def _chunk_result(self, payload: Any, prompts: list[str], offset: int, where: str) -> RewardResult:
        what = f"{self.description} returned a bad value for {where}"
        finite = not self.keep_non_finite
        if isinstance(payload, dict):
            if "rewards" not in payload:
                keys = ", ".join(sorted(map(repr, payload))) or "none"  # repr: keys of any type sort as text
                raise RewardError(f"{what}: a dict result needs a 'rewards' key (got keys {keys})")
            metrics = {
                str(name): to_float_list(values, len(prompts), f"{what} (metric '{name}')", prompts, offset, finite)
                for name, values in payload.items()
                if name != "rewards"
            }
            return RewardResult(to_float_list(payload["rewards"], len(prompts), what, prompts, offset, finite), metrics)
        return RewardResult(to_float_list(payload, len(prompts), what, prompts, offset, finite))
