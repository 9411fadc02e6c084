"""Trainer -> rollout-engine weight sync over private gloo groups.

Protocol. The trainer (rank 0 of the training engine, which holds the gathered full
weights) opens one small group per engine: a ``TCPStore`` it hosts plus a
``ProcessGroupGloo`` object (no ``init_process_group``, so the trainer's own default
group and vLLM's groups are untouched). The engine's workers join as ranks
``1..world_size-1`` (one per tensor-parallel worker: each receives the full weights and
its model's ``load_weights`` keeps its shard). A sync is a stream of size-bounded buckets,
each with its checksum (:mod:`raylign.rollout.sync_wire`). The engine loads the tensors as they
arrive and then resets its prefix cache. One Ray call per engine per sync starts the receiving
side; tensors never travel as individual remote calls.

Verification. Every sync carries a version (the trainer's count of updates). The engine's
answer to the sync is a :class:`SyncReceipt`: the version it now holds and the checksum of all
it received, which the sender checks against its own; a bucket damaged on the way already
fails on arrival. Whether the loaded weights compute what the trainer's do is checked
separately, by a probe (:mod:`raylign.rl.verify`).

Why one group per engine rather than one group with every engine's workers: an engine
can be replaced (restart after a failure, elastic scaling) by opening one new group,
without rebuilding a group the others are in; a slow or dead engine fails only its own
broadcast; the broadcasts to different groups run concurrently (gloo works in
background threads). gloo's broadcast sends the buffer from the root to every peer in
either layout, so a shared group would save no bandwidth.

Colocated engines (in the trainer's own process) skip all of this: hand the iterator to
``await engine.update_weights(named_tensors)``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raylign.cluster import get_within, remote_cause
from raylign.rollout.buckets import Bucket, BufferPool, iter_packed_buckets
from raylign.rollout.sync_wire import (  # noqa: F401 - the receiving side's names, re-exported
    CORRUPTION_ADVICE,
    LIVENESS_CHECK_S,
    TIMEOUT_SETTING,
    IncomingSync,
    ReceiverDied,
    SentSync,
    WeightSyncCorrupted,
    WeightSyncMismatch,
    load_and_drain,
    send_buckets,
)

logger = logging.getLogger(__name__)

TIED_EMBEDDING_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"


def open_group_as_sender(host: str, world_size: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Host the rendezvous store of a new group on a free port; returns (store, port)."""
    store = dist.TCPStore(host, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, store.port


def make_gloo_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroupGloo:
    """Create the gloo group object; blocks until all ``world_size`` ranks have called it."""
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


_retired: list[Any] = []


def retire_group(group: Any) -> None:
    """Keep a sync group this process no longer uses (its store with it) referenced until the process ends.

    Dropping a gloo group's last reference joins its worker threads while holding the GIL, and a
    worker still releasing the Python tensors of a finished or aborted broadcast waits for the GIL:
    the process hangs (:func:`raylign.engine.distributed.exit_process`). Groups are retired only
    when an engine leaves or is replaced, so the idle threads and sockets kept are few."""
    if group is not None:
        _retired.append(group)


def retired_groups() -> int:
    """How many groups this process has retired."""
    return len(_retired)


def join_group_as_receiver(
    host: str, port: int, rank: int, world_size: int, timeout_s: float
) -> tuple[dist.TCPStore, dist.ProcessGroupGloo]:
    """Connect to the sender's store and join its group as ``rank`` (>= 1)."""
    if not 1 <= rank < world_size:
        raise ValueError(f"receiver rank must be in [1, {world_size}), got {rank}")
    store = dist.TCPStore(host, port, world_size, False, timeout=timedelta(seconds=timeout_s))
    return store, make_gloo_group(store, rank, world_size, timeout_s)


def with_tied_lm_head(
    named_tensors: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """For tied models, send the embedding also as ``lm_head.weight`` and drop any other copy.

    vLLM on CPU keeps a separately repacked output head even for tied models, and
    trainers' state dicts may or may not list ``lm_head.weight`` for them; without this
    the engine would silently keep sampling from the old head.
    """
    for name, tensor in named_tensors:
        if tie_word_embeddings and name == LM_HEAD_NAME:
            continue
        yield name, tensor
        if tie_word_embeddings and name == TIED_EMBEDDING_NAME:
            yield LM_HEAD_NAME, tensor


class TimedIterator:
    """Iterates ``source``, adding up in :attr:`seconds` the time spent producing its items
    (a weight stream's gathering, apart from what its consumer does with them)."""

    def __init__(self, source: Iterable[tuple[str, torch.Tensor]]):
        self.source, self.seconds = iter(source), 0.0

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        start = time.perf_counter()
        try:
            return next(self.source)
        finally:
            self.seconds += time.perf_counter() - start


def check_receipts(
    receipts: Sequence[SyncReceipt], sent: SentSync, version: int | None, indices: Sequence[int], label: str
) -> None:
    """Each engine must hold ``version`` (when given) and have received exactly what was sent."""
    for index, receipt in zip(indices, receipts):
        if version is not None and receipt.version != version:
            raise WeightSyncMismatch(
                f"{label}: engine {index} reports weight version {receipt.version} after loading version {version}; "
                "its version count is out of step with the trainer's (an engine restarted outside the run's control?)"
            )
        if (receipt.checksum, receipt.num_buckets) != (sent.checksum, sent.num_buckets):
            raise WeightSyncCorrupted(
                f"{label}: engine {index} received {receipt.num_buckets} bucket(s) with checksum "
                f"{receipt.checksum:#018x}, the trainer sent {sent.num_buckets} with {sent.checksum:#018x}; "
                f"{CORRUPTION_ADVICE}"
            )


def _gone_receivers(loading: list[Any]) -> set[int]:
    """The positions ``i`` whose engine's call to receive this sync (``loading[i]``) has ended in an
    error while the sync is being sent: its process died, or the call failed before taking the sync
    in (it takes no further part in the broadcasts either way)."""
    import ray

    ready, _ = ray.wait(loading, num_returns=len(loading), timeout=0)
    return {loading.index(ref) for ref in ready if _call_error(ref) is not None}


def _died(error: BaseException | None) -> bool:
    """Whether a Ray call ended because the actor's process died."""
    import ray

    return isinstance(error, ray.exceptions.RayActorError)


def _call_error(ref: Any) -> BaseException | None:
    """The error a finished Ray call ended with, or None if it returned."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError("_call_error on a call that has not finished") from None
    except Exception as err:
        return err
    return None


@dataclass
class SyncStats:
    seconds: float
    num_buckets: int
    num_tensors: int
    num_bytes: int
    engine_version: int  # the weight version the engines report they hold now
    engine_s: float = 0.0  # the slowest engine's time from the call to receive until it ran again
    engine_waited_s: float = 0.0  # the most time an engine waited for buckets


@dataclass
class SyncReceipt:
    """An engine's answer to a sync: the weight version it holds now, and :func:`combine_checksums`
    of the buckets it received (what the sender computed, unless bytes changed on the way)."""

    version: int
    checksum: int
    num_buckets: int
    seconds: float  # from the call to receive until the engine runs again
    waited_s: float = 0.0  # of which waiting for buckets to arrive (the rest is loading them, and pausing)


def local_host_address() -> str:
    """An address of this machine the engines can reach (Ray's node address when Ray runs)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


class WeightSyncSender:
    """Trainer side of the weight sync to a set of engine actors.

    ``engines`` are Ray actor handles of :class:`~raylign.rollout.base.RolloutEngine`
    classes. Call :meth:`connect` once, :meth:`sync` after every optimizer step (on the
    rank that holds the full weights), :meth:`close` at the end.
    """

    def __init__(
        self, engines: Sequence[Any], bucket_mb: float = 32.0, timeout_s: float = 600.0, host: str | None = None
    ):
        self.engines = list(engines)
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.timeout_s = timeout_s
        self.host = host
        self._stores: list[dist.TCPStore] = []
        self._groups: list[dist.ProcessGroupGloo] = []
        self._buffers = BufferPool()  # kept from sync to sync: packing writes into memory it already has

    def _results(self, refs: list[Any], what: str, names: Sequence[str] | None = None) -> list[Any]:
        """The engines' answers to one call each, waiting at most ``timeout_s``."""
        return get_within(
            refs,
            self.timeout_s,
            f"weight sync: {what}",
            TIMEOUT_SETTING,
            names or [f"engine {i}" for i in range(len(refs))],
        )

    def connect(self) -> None:
        """Open one group per engine; each engine's workers join it."""
        host = self.host or local_host_address()
        for index, engine in enumerate(self.engines):
            store, group = self._open(index, engine, host)
            self._stores.append(store)
            self._groups.append(group)
        logger.info("weight sync: connected to %d engine(s) at %s", len(self.engines), host)

    def _open(self, index: int, engine: Any, host: str) -> tuple[dist.TCPStore, dist.ProcessGroupGloo]:
        """A new group with engine ``index``'s workers in it."""
        world_size = (
            1 + self._results([engine.num_sync_ranks.remote()], "the engine's sync ranks", [f"engine {index}"])[0]
        )
        store, port = open_group_as_sender(host, world_size, self.timeout_s)
        joined = engine.join_weight_sync_group.remote(host, port, world_size, self.timeout_s)
        group = self._group_once_joined(store, world_size, joined, index)
        get_within(joined, self.timeout_s, "weight sync: joining the group", TIMEOUT_SETTING, [f"engine {index}"])
        return store, group

    def _group_once_joined(
        self, store: dist.TCPStore, world_size: int, joined: Any, index: int
    ) -> dist.ProcessGroupGloo:
        """The sender's side of the group, which forms once the engine's workers join it (a thread
        waits for that); if the engine's call to join fails first, its error, at once, rather than
        gloo's after ``timeout_s``."""
        import ray

        made: dict[str, Any] = {}

        def make() -> None:
            try:
                made["group"] = make_gloo_group(store, 0, world_size, self.timeout_s)
            except BaseException as err:  # handed to the caller below
                made["error"] = err

        # A daemon: when the engine failed, the thread ends by itself at the group's timeout.
        forming = threading.Thread(target=make, name=f"sync-group-{index}", daemon=True)
        forming.start()
        while forming.is_alive():
            forming.join(LIVENESS_CHECK_S)
            done, _ = ray.wait([joined], timeout=0)
            if done and forming.is_alive() and (error := _call_error(joined)) is not None:
                raise RuntimeError(
                    f"weight sync: engine {index} could not join its sync group: {remote_cause(error)}"
                ) from error
        if "error" in made:
            err = made["error"]
            raise RuntimeError(
                f"weight sync: the sync group with engine {index} (world size {world_size}, store "
                f"{store.host}:{store.port}) did not form within {TIMEOUT_SETTING}={self.timeout_s:g} s: "
                f"{type(err).__name__}: {err}. The engine's workers must reach this host on the store's port "
                "and on gloo's own TCP ports"
            ) from err
        return made["group"]

    def replace(self, index: int, engine: Any) -> None:
        """A new engine took the place of engine ``index`` (which died): its own new group replaces the old."""
        self.engines[index] = engine
        retire_group((self._stores[index], self._groups[index]))
        self._stores[index], self._groups[index] = self._open(index, engine, self.host or local_host_address())
        logger.info("weight sync: reconnected engine %d", index)

    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        keep_running: bool = False,
        version: int | None = None,
        only: Sequence[int] | None = None,
        adapter: dict[str, Any] | None = None,
    ) -> SyncStats:
        """Send full weights (Hugging Face names) to every engine, or to the engines ``only``; returns
        when they have loaded them.

        ``keep_running``: sequences in flight continue under the new weights (partial rollouts)
        instead of finishing first; see :meth:`RolloutEngine.receive_weights`. ``adapter``: the
        tensors are LoRA adapter weights with this PEFT config (:meth:`RolloutEngine.receive_adapter`)."""
        if not self._groups:
            raise RuntimeError("WeightSyncSender.sync() before connect()")
        indices = list(range(len(self.engines))) if only is None else list(only)
        label = "weight sync" if version is None else f"weight sync {version}"
        start = time.perf_counter()
        loading = [
            self.engines[i].receive_weights.remote(keep_running, version)
            if adapter is None
            else self.engines[i].receive_adapter.remote(adapter, version)
            for i in indices
        ]
        try:
            sent = send_buckets(
                [self._groups[i] for i in indices],
                self.pack(named_tensors),
                lambda: _gone_receivers(loading),
            )
        except ReceiverDied as err:
            self._await_aborted(loading, indices)
            failed = [(p, e) for p in err.positions if not _died(e := _call_error(loading[p]))]
            if failed:  # alive, but its call failed: its own error says why
                position, error = failed[0]
                raise RuntimeError(
                    f"{label}: engine {indices[position]} failed to receive it, and the others were told to "
                    f"abort it: {remote_cause(error)}"
                ) from error
            dead = [indices[p] for p in err.positions]
            raise ReceiverDied(
                f"{label}: engine(s) {dead} died during the sync; the others were told to abort it", dead
            ) from err
        except BaseException:
            self._await_aborted(loading, indices)
            raise
        receipts = self._receipts(loading, indices, label)
        check_receipts(receipts, sent, version, indices, label)
        stats = SyncStats(
            time.perf_counter() - start,
            sent.num_buckets,
            sent.num_tensors,
            sent.num_bytes,
            max(r.version for r in receipts),
            max(r.seconds for r in receipts),
            max(r.waited_s for r in receipts),
        )
        logger.info(
            "weight sync: %d tensors, %.1f MiB in %d buckets to %d engine(s) in %.3f s",
            stats.num_tensors,
            stats.num_bytes / (1 << 20),
            stats.num_buckets,
            len(indices),
            stats.seconds,
        )
        return stats

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        """The buckets of one sync, each with the checksum of its bytes as packed. Whatever happens
        to the bytes after this (the network, memory, a test that overrides this method to flip
        some) is what the engines' checksums catch."""
        return iter_packed_buckets(named_tensors, self.bucket_bytes, self._buffers)

    def _receipts(self, loading: list[Any], indices: list[int], label: str) -> list[SyncReceipt]:
        """The engines' receipts, in order, within ``timeout_s`` in all; a damaged sync is named with its engine."""
        deadline = time.monotonic() + self.timeout_s
        receipts = []
        for index, ref in zip(indices, loading):
            try:
                receipts.append(
                    get_within(
                        ref,
                        max(0.0, deadline - time.monotonic()),
                        f"{label}: loading the new weights",
                        TIMEOUT_SETTING,
                        [f"engine {index}"],
                    )
                )
            except WeightSyncCorrupted as err:  # Ray's error for it is also an instance of the engine's
                raise WeightSyncCorrupted(f"engine {index}: {getattr(err, 'cause', err)}") from None
        return receipts

    def _await_aborted(self, loading: list[Any], indices: Sequence[int]) -> None:
        """Let the engines finish failing, so the next sync finds them idle; their errors follow from
        ours. All of them within one ``timeout_s``."""
        import ray

        finished, pending = ray.wait(loading, num_returns=len(loading), timeout=self.timeout_s)
        for ref in finished:
            error = _call_error(ref)
            if error is not None:  # expected: "weight sync aborted by the sender"
                logger.warning(
                    "weight sync: engine %d reported after abort: %s", indices[loading.index(ref)], remote_cause(error)
                )
        if pending:
            late = [indices[loading.index(ref)] for ref in pending]
            logger.warning(
                "weight sync: engine(s) %s had not ended the aborted sync after %s=%g s",
                late,
                TIMEOUT_SETTING,
                self.timeout_s,
            )

    def close(self) -> None:
        if self._groups:
            self._results([engine.leave_weight_sync_group.remote() for engine in self.engines], "leaving the group")
        for pair in zip(self._stores, self._groups):
            retire_group(pair)
        self._groups.clear()
        self._stores.clear()
