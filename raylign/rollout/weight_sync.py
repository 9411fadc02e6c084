"""Trainer -> rollout-engine weight sync over private gloo groups.

Protocol. The trainer (rank 0 of the training engine, which holds the gathered full
weights) opens one small group per engine: a ``TCPStore`` it hosts plus a
``ProcessGroupGloo`` object (no ``init_process_group``, so the trainer's own default
group and vLLM's groups are untouched). The engine's workers join as ranks
``1..world_size-1`` (one per tensor-parallel worker: each receives the full weights and
its model's ``load_weights`` keeps its shard). A sync is, per bucket, three broadcasts
from rank 0: ``[header_len, payload_len]`` (int64), the pickled metadata, the flat uint8
payload; a header length of 0 ends the sync, -1 aborts it (the sender failed part-way;
the engine raises, and holds partly updated weights until the next full sync). The engine loads the
tensors as they arrive and then resets its prefix cache. One Ray call per engine per sync starts the receiving
side; tensors never travel as individual remote calls.

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
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raylign.cluster import get_within
from raylign.rollout.buckets import Bucket, iter_packed_buckets, metas_from_header, unpack_bucket

logger = logging.getLogger(__name__)

TIED_EMBEDDING_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"
TIMEOUT_SETTING = "rollout.sync_timeout_s"


def open_group_as_sender(host: str, world_size: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Host the rendezvous store of a new group on a free port; returns (store, port)."""
    store = dist.TCPStore(host, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, store.port


def make_gloo_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroupGloo:
    """Create the gloo group object; blocks until all ``world_size`` ranks have called it."""
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


def join_group_as_receiver(
    host: str, port: int, rank: int, world_size: int, timeout_s: float
) -> tuple[dist.TCPStore, dist.ProcessGroupGloo]:
    """Connect to the sender's store and join its group as ``rank`` (>= 1)."""
    if not 1 <= rank < world_size:
        raise ValueError(f"receiver rank must be in [1, {world_size}), got {rank}")
    store = dist.TCPStore(host, port, world_size, False, timeout=timedelta(seconds=timeout_s))
    return store, make_gloo_group(store, rank, world_size, timeout_s)


def _broadcast(group: dist.ProcessGroupGloo, tensor: torch.Tensor) -> Any:
    return group.broadcast([tensor], dist.BroadcastOptions())  # root 0 by default; returns a Work


class ReceiverDied(RuntimeError):
    """Receiving engines' processes died during a sync (the others were sent the abort marker)."""


# How often a sender waiting on broadcasts asks whether the receiving engines are still alive.
LIVENESS_CHECK_S = 0.2


def _wait_all(works: Sequence[Any], dead_receivers: Callable[[], set[int]] | None = None) -> set[int]:
    """Wait for broadcasts in flight, ``works[i]`` to group ``i``. Each fails by itself after its
    group's timeout (the one given to :func:`make_gloo_group`, or to the colocated policy ranks'
    group: rollout.sync_timeout_s).

    A broadcast to a process that died is not failed by gloo until that timeout, so a sender
    that can tell (``dead_receivers()``: the groups whose receiver died) polls instead, asking
    every :data:`LIVENESS_CHECK_S`, and stops waiting for those groups; returns them."""
    dead: set[int] = set()
    if dead_receivers is not None:
        delay, checked = 1e-4, time.monotonic()
        while not all(work.is_completed() for i, work in enumerate(works) if i not in dead):
            if time.monotonic() - checked > LIVENESS_CHECK_S:
                dead |= dead_receivers() & set(range(len(works)))
                checked = time.monotonic()
            time.sleep(delay)
            delay = min(2 * delay, 0.01)
    for i, work in enumerate(works):
        if i in dead:
            continue
        try:
            work.wait()
        except RuntimeError as err:
            if dead_receivers is not None and _receiver_died(i, dead_receivers):
                dead.add(i)  # gloo saw the connection close before the receiver's death was known
                continue
            if "timed out" not in str(err).lower():
                raise
            raise TimeoutError(
                f"weight sync: the other side of a broadcast did not take part within the group's "
                f"timeout; raise {TIMEOUT_SETTING} if it needs longer, or check the other side's logs "
                f"(gloo: {err})"
            ) from err
    return dead


# How long a broadcast that failed waits to learn whether its receiver died (then it is left out).
DEATH_NOTICE_S = 30.0


def _receiver_died(position: int, dead_receivers: Callable[[], set[int]]) -> bool:
    deadline = time.monotonic() + DEATH_NOTICE_S
    while time.monotonic() < deadline:
        if position in dead_receivers():
            return True
        time.sleep(LIVENESS_CHECK_S)
    return False


class _Broadcasts:
    """The sender's side of one sync: broadcasts to every group whose receiver is alive."""

    def __init__(self, groups: Sequence[dist.ProcessGroupGloo], dead_receivers: Callable[[], set[int]] | None):
        self.groups, self.dead_receivers = list(groups), dead_receivers
        self.dead: set[int] = set()

    def send(self, tensor: torch.Tensor) -> None:
        live = [i for i in range(len(self.groups)) if i not in self.dead]
        dead = _wait_all(
            [_broadcast(self.groups[i], tensor) for i in live],
            None
            if self.dead_receivers is None
            else lambda: {live.index(i) for i in self.dead_receivers() if i in live},
        )
        self.dead |= {live[i] for i in dead}

    def bucket(self, bucket: Bucket) -> None:
        """One bucket (three broadcasts); a receiver that dies meanwhile is left out from then on."""
        header = torch.frombuffer(bytearray(bucket.header_bytes()), dtype=torch.uint8)
        for tensor in (torch.tensor([header.numel(), bucket.buffer.numel()], dtype=torch.int64), header, bucket.buffer):
            self.send(tensor)

    def marker(self, marker: int) -> None:
        self.send(torch.tensor([marker, 0], dtype=torch.int64))


def send_bucket(groups: Sequence[dist.ProcessGroupGloo], bucket: Bucket) -> None:
    """Broadcast one bucket to every group, the groups in parallel."""
    _Broadcasts(groups, None).bucket(bucket)


END_OF_SYNC, ABORT_SYNC = 0, -1


def send_end_of_sync(groups: Sequence[dist.ProcessGroupGloo], marker: int = END_OF_SYNC) -> None:
    _Broadcasts(groups, None).marker(marker)


def send_named_tensors(
    groups: Sequence[dist.ProcessGroupGloo],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dead_receivers: Callable[[], set[int]] | None = None,
) -> tuple[int, int, int]:
    """Broadcast one whole sync in buckets, then its end marker; ``(buckets, tensors, bytes)`` sent.

    If packing or sending fails, the receivers get the abort marker at once (rather than waiting
    for the gloo timeout) and the error is re-raised. ``dead_receivers()``: the positions of the
    groups whose receiver died; once one has, the others are sent the abort marker after the
    bucket they are in, and :class:`ReceiverDied` is raised."""
    num_buckets = num_tensors = num_bytes = 0
    out = _Broadcasts(groups, dead_receivers)
    try:
        for bucket in iter_packed_buckets(named_tensors, bucket_bytes):
            out.bucket(bucket)
            if out.dead:
                raise ReceiverDied(f"weight sync: the receivers of group(s) {sorted(out.dead)} died during the sync")
            num_buckets += 1
            num_tensors += len(bucket.metas)
            num_bytes += bucket.buffer.numel()
    except BaseException:
        out.marker(ABORT_SYNC)
        raise
    out.marker(END_OF_SYNC)
    if out.dead:  # died at the very end: it missed the end marker
        raise ReceiverDied(f"weight sync: the receivers of group(s) {sorted(out.dead)} died during the sync")
    return num_buckets, num_tensors, num_bytes


def receive_named_tensors(group: dist.ProcessGroupGloo) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors of one sync as they arrive (views into a new buffer per bucket)."""
    while True:
        sizes = torch.empty(2, dtype=torch.int64)
        _wait_all([_broadcast(group, sizes)])
        header_len, payload_len = (int(v) for v in sizes)
        if header_len == END_OF_SYNC:
            return
        if header_len == ABORT_SYNC:
            raise RuntimeError("weight sync aborted by the sender; the engine holds partly updated weights")
        header = torch.empty(header_len, dtype=torch.uint8)
        _wait_all([_broadcast(group, header)])
        payload = torch.empty(payload_len, dtype=torch.uint8)  # new buffer per bucket, never reused
        _wait_all([_broadcast(group, payload)])
        yield from unpack_bucket(Bucket(metas_from_header(header.numpy().tobytes()), payload))


def load_and_drain(stream: Iterator[tuple[str, torch.Tensor]], load: Any) -> None:
    """Run ``load(stream)``; if it fails, still receive the rest of the sync, then re-raise.

    Draining keeps the sender from blocking on broadcasts nobody receives, so the
    error reaches the trainer at once instead of after the group timeout.
    """
    try:
        load(stream)
    except BaseException:
        for _ in stream:
            pass
        raise
    for _ in stream:  # a loader that stopped early must not leave buckets in flight
        pass


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


def _dead_receivers(loading: list[Any]) -> set[int]:
    """The positions ``i`` whose engine's call to receive this sync (``loading[i]``) failed because
    its process died."""
    import ray

    ready, _ = ray.wait(loading, num_returns=len(loading), timeout=0)
    dead = set()
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead.add(loading.index(ref))
        except Exception:  # it failed otherwise: its own error comes back from the sync
            pass
    return dead


@dataclass
class SyncStats:
    seconds: float
    num_buckets: int
    num_tensors: int
    num_bytes: int


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
        group = make_gloo_group(store, 0, world_size, self.timeout_s)  # returns once the engine joined
        get_within(joined, self.timeout_s, "weight sync: joining the group", TIMEOUT_SETTING, [f"engine {index}"])
        return store, group

    def replace(self, index: int, engine: Any) -> None:
        """A new engine took the place of engine ``index`` (which died): its own new group replaces the old."""
        self.engines[index] = engine
        self._stores[index], self._groups[index] = self._open(index, engine, self.host or local_host_address())
        logger.info("weight sync: reconnected engine %d", index)

    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        keep_running: bool = False,
        version: int | None = None,
        only: Sequence[int] | None = None,
    ) -> SyncStats:
        """Send full weights (Hugging Face names) to every engine, or to the engines ``only``; returns
        when they have loaded them.

        ``keep_running``: sequences in flight continue under the new weights (partial rollouts)
        instead of finishing first; see :meth:`RolloutEngine.receive_weights`."""
        if not self._groups:
            raise RuntimeError("WeightSyncSender.sync() before connect()")
        indices = list(range(len(self.engines))) if only is None else list(only)
        start = time.perf_counter()
        loading = [self.engines[i].receive_weights.remote(keep_running, version) for i in indices]
        try:
            num_buckets, num_tensors, num_bytes = send_named_tensors(
                [self._groups[i] for i in indices], named_tensors, self.bucket_bytes, lambda: _dead_receivers(loading)
            )
        except BaseException:
            self._await_aborted(loading)
            raise
        self._results(loading, "loading the new weights", [f"engine {i}" for i in indices])
        stats = SyncStats(time.perf_counter() - start, num_buckets, num_tensors, num_bytes)
        logger.info(
            "weight sync: %d tensors, %.1f MiB in %d buckets to %d engine(s) in %.3f s",
            stats.num_tensors,
            stats.num_bytes / (1 << 20),
            stats.num_buckets,
            len(indices),
            stats.seconds,
        )
        return stats

    def _await_aborted(self, loading: list[Any]) -> None:
        """Let the engines finish failing, so the next sync finds them idle; their errors follow from ours."""
        import ray

        for ref in loading:
            try:
                ray.get(ref, timeout=self.timeout_s)
            except Exception as err:  # expected: "weight sync aborted by the sender"
                logger.warning("weight sync: engine reported after abort: %s", str(err).splitlines()[-1])

    def close(self) -> None:
        if self._groups:
            self._results([engine.leave_weight_sync_group.remote() for engine in self.engines], "leaving the group")
        self._groups.clear()
        self._stores.clear()
