"""The wire protocol of a weight sync: buckets broadcast over a gloo group, checked on arrival.

A sync is, per bucket, three broadcasts from rank 0: ``[header_len, payload_len, checksum]``
(int64), the pickled metadata, the flat uint8 payload; a header length of 0 ends the sync, -1
aborts it (the sender failed part-way; the receiver raises, and holds partly updated weights until
the next full sync). ``checksum`` is the bucket's XXH3-64 as packed (its bits as an int64)
(:func:`~raylign.rollout.buckets.bucket_checksum`); the receiver computes it again on what
arrived and stops at the first bucket that differs (:class:`WeightSyncCorrupted`, naming the
sync and the bucket), after taking in the rest of the sync so that the sender finishes at once
instead of waiting for the group's timeout.

Used between the trainer and the engines' workers (:mod:`raylign.rollout.weight_sync`) and
between the policy ranks of a colocated run (:mod:`raylign.rl.worker`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raylign.rollout.buckets import (
    Bucket,
    BufferPool,
    bucket_checksum,
    checksum_from_int64,
    checksum_to_int64,
    combine_checksums,
    metas_from_header,
    unpack_bucket,
)

TIMEOUT_SETTING = "rollout.sync_timeout_s"


def _broadcast(group: dist.ProcessGroupGloo, tensor: torch.Tensor) -> Any:
    return group.broadcast([tensor], dist.BroadcastOptions())  # root 0 by default; returns a Work


class ReceiverDied(RuntimeError):
    """Receiving engines' processes died, or their calls to receive failed, during a sync (the others
    were sent the abort marker);
    ``positions``: theirs in the list of groups the sync went to."""

    def __init__(self, message: str, positions: Sequence[int] = ()):
        super().__init__(message)
        self.positions = list(positions)


class WeightSyncCorrupted(RuntimeError):
    """The bytes an engine received differ from those the trainer sent (checksum mismatch)."""


class WeightSyncMismatch(RuntimeError):
    """An engine reports a weight version other than the one the trainer just sent."""


CORRUPTION_ADVICE = (
    "the engine holds partly updated weights and the run cannot continue with them; resume from the last "
    "checkpoint, and if it happens again check the machines' memory (ECC errors in the kernel log) and network"
)


# How often a sender waiting on broadcasts asks whether the receiving engines are still alive.
LIVENESS_CHECK_S = 0.2
# The longest nap between two looks at broadcasts in flight: a bucket's broadcast takes milliseconds,
# and each nap's overshoot is time the sync loses.
POLL_MAX_S = 0.001


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
            delay = min(2 * delay, POLL_MAX_S)
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


@dataclass
class _Posted:
    """One bucket's broadcasts in flight: per broadcast, the groups it went to and gloo's handles.
    Holding the bucket keeps its buffer from being reused before they are done."""

    bucket: Bucket
    broadcasts: list[tuple[list[int], list[Any], torch.Tensor]]


class _Broadcasts:
    """The sender's side of one sync: broadcasts to every group whose receiver is alive."""

    def __init__(self, groups: Sequence[dist.ProcessGroupGloo], dead_receivers: Callable[[], set[int]] | None):
        self.groups, self.dead_receivers = list(groups), dead_receivers
        self.dead: set[int] = set()

    def _post(self, tensor: torch.Tensor) -> tuple[list[int], list[Any], torch.Tensor]:
        live = [i for i in range(len(self.groups)) if i not in self.dead]
        return live, [_broadcast(self.groups[i], tensor) for i in live], tensor

    def _wait(self, live: list[int], works: list[Any]) -> None:
        """Wait for broadcasts posted to the groups ``live``; a receiver that died is left out from then on."""
        pending = [(i, work) for i, work in zip(live, works) if i not in self.dead]
        live, works = [i for i, _ in pending], [work for _, work in pending]
        dead = _wait_all(
            works,
            None
            if self.dead_receivers is None
            else lambda: {live.index(i) for i in self.dead_receivers() if i in live},
        )
        self.dead |= {live[i] for i in dead}

    def start(self, bucket: Bucket) -> _Posted:
        """Post one bucket's three broadcasts; gloo's threads send them while the caller packs the next."""
        header = torch.frombuffer(bytearray(bucket.header_bytes()), dtype=torch.uint8)
        sizes = torch.tensor(
            [header.numel(), bucket.buffer.numel(), checksum_to_int64(bucket.checksum)], dtype=torch.int64
        )
        return _Posted(bucket, [self._post(tensor) for tensor in (sizes, header, bucket.buffer)])

    def finish(self, posted: _Posted) -> None:
        for live, works, _ in posted.broadcasts:
            self._wait(live, works)

    def marker(self, marker: int) -> None:
        live, works, _ = self._post(torch.tensor([marker, 0, 0], dtype=torch.int64))
        self._wait(live, works)


END_OF_SYNC, ABORT_SYNC = 0, -1


@dataclass
class SentSync:
    """What the sender broadcast in one sync; ``checksum``: :func:`combine_checksums` of its buckets'."""

    num_buckets: int = 0
    num_tensors: int = 0
    num_bytes: int = 0
    checksum: int = 0


def send_buckets(
    groups: Sequence[dist.ProcessGroupGloo],
    buckets: Iterable[Bucket],
    dead_receivers: Callable[[], set[int]] | None = None,
) -> SentSync:
    """Broadcast one whole sync, bucket by bucket (each with the checksum it was packed with), then
    its end marker. The next bucket is packed while the one before is on the wire.

    If packing or sending fails, the receivers get the abort marker at once (rather than waiting
    for the gloo timeout) and the error is re-raised. ``dead_receivers()``: the positions of the
    groups whose receiver is gone (its process died, or its call to receive failed); once one is,
    the others are sent the abort marker after the bucket they are in, and :class:`ReceiverDied`
    is raised."""
    sent, checksums = SentSync(), []
    out = _Broadcasts(groups, dead_receivers)
    posted: _Posted | None = None

    def finish(posted: _Posted) -> None:
        out.finish(posted)
        if out.dead:
            raise ReceiverDied(f"weight sync: the receivers of group(s) {sorted(out.dead)} died", sorted(out.dead))
        checksums.append(posted.bucket.checksum)
        sent.num_buckets += 1
        sent.num_tensors += len(posted.bucket.metas)
        sent.num_bytes += posted.bucket.buffer.numel()

    try:
        for bucket in buckets:  # packing this bucket overlapped the broadcasts of the one before
            if posted is not None:
                finish(posted)
            posted = out.start(bucket)
        if posted is not None:
            finish(posted)
    except BaseException:
        # Posted after the broadcasts in flight (gloo keeps a group's order), which finish first.
        out.marker(ABORT_SYNC)
        raise
    out.marker(END_OF_SYNC)
    if out.dead:  # died at the very end: it missed the end marker
        raise ReceiverDied(f"weight sync: the receivers of group(s) {sorted(out.dead)} died", sorted(out.dead))
    sent.checksum = combine_checksums(checksums)
    return sent


class IncomingSync:
    """The tensors of one sync, yielded as they arrive (views into a bucket's buffer), each bucket
    checked against the checksum the sender packed it with.

    After a complete iteration :attr:`checksum` and :attr:`num_buckets` describe what arrived, and
    :attr:`waited_s` says how long the consumer waited for buckets to arrive and be checked.
    A bucket that arrived damaged raises :class:`WeightSyncCorrupted` once the rest of the sync has
    been taken in (and discarded), so the sender finishes instead of waiting for the group timeout.
    ``version`` and ``receiver`` only name the sync and the receiving side in errors. ``pool``: where
    the buckets' buffers come from; a receiver that keeps one from sync to sync writes into memory
    it already has (see :class:`~raylign.rollout.buckets.BufferPool`)."""

    def __init__(
        self,
        group: dist.ProcessGroupGloo,
        version: int | None = None,
        receiver: str = "this engine",
        pool: BufferPool | None = None,
    ):
        self.group, self.receiver, self.pool = group, receiver, pool or BufferPool()
        self.label = "weight sync" if version is None else f"weight sync {version}"
        self.checksums: list[int] = []
        self.corruption: str | None = None  # the error of a damaged bucket, once one arrived
        self.waited_s = 0.0  # how long the consumer waited for buckets to arrive and be checked
        self._tensors = self._receive()

    def __iter__(self) -> IncomingSync:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._tensors)

    @property
    def num_buckets(self) -> int:
        return len(self.checksums)

    @property
    def checksum(self) -> int:
        return combine_checksums(self.checksums)

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        buckets = self._checked_buckets()
        while True:
            start = time.perf_counter()
            bucket = next(buckets, None)
            self.waited_s += time.perf_counter() - start
            if bucket is None:
                return
            found, tensors = bucket
            self.checksums.append(found)
            yield from tensors

    def _checked_buckets(self) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
        """Each bucket's checksum and tensors, taken in and checked, in reused buffers
        (:class:`~raylign.rollout.buckets.BufferPool`: one is written again only once the model let go
        of every tensor in it)."""
        index = 0
        while (bucket := self._next_bucket(index, self.pool)) is not None:
            header, payload, sent = bucket
            found = bucket_checksum(header, payload)
            if found != sent:
                self.corruption = (
                    f"{self.label}: bucket {index} reached {self.receiver} damaged (checksum "
                    f"{found:#018x}, sent {sent:#018x}); {CORRUPTION_ADVICE}"
                )
                self._discard_rest(index + 1)
                raise WeightSyncCorrupted(self.corruption)
            yield found, unpack_bucket(Bucket(metas_from_header(header), payload))
            index += 1

    def _next_bucket(self, index: int, pool: BufferPool) -> tuple[bytes, torch.Tensor, int] | None:
        """``(header bytes, payload, checksum sent)`` of bucket ``index``; None at the end of the sync."""
        sizes = self._take(torch.empty(3, dtype=torch.int64), index, "sizes")
        header_len, payload_len, sent = (int(v) for v in sizes)
        if header_len == END_OF_SYNC:
            return None
        if header_len == ABORT_SYNC:
            raise RuntimeError(
                f"{self.label} aborted by the sender after {index} bucket(s); {self.receiver} holds partly "
                "updated weights until the next full sync"
            )
        header = self._take(torch.empty(header_len, dtype=torch.uint8), index, "header").numpy().tobytes()
        payload = self._take(pool.take(payload_len), index, "payload")
        return header, payload, checksum_from_int64(sent)

    def _take(self, tensor: torch.Tensor, index: int, what: str) -> torch.Tensor:
        """Receive one broadcast; a failure (the sender died, the group timed out) names the sync and the bucket."""
        try:
            _wait_all([_broadcast(self.group, tensor)])
        except (RuntimeError, TimeoutError) as err:
            message = (
                f"{self.label}: receiving the {what} of bucket {index} failed ({str(err).splitlines()[0]}); the "
                f"sender died, stalled past {TIMEOUT_SETTING} or lost its connection; {self.receiver} holds partly "
                "updated weights until the next full sync"
            )
            raise (TimeoutError if isinstance(err, TimeoutError) else RuntimeError)(message) from err
        return tensor

    def _discard_rest(self, index: int) -> None:
        """Take in the remaining buckets of the sync, from bucket ``index`` on, without looking at them."""
        while True:
            sizes = self._take(torch.empty(3, dtype=torch.int64), index, "sizes")
            header_len, payload_len, _ = (int(v) for v in sizes)
            if header_len in (END_OF_SYNC, ABORT_SYNC):
                return
            self._take(torch.empty(header_len, dtype=torch.uint8), index, "header")
            self._take(torch.empty(payload_len, dtype=torch.uint8), index, "payload")
            index += 1


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
