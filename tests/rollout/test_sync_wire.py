"""The weight-sync wire protocol between two real gloo ranks of one process (a thread each): every
bucket carries the XXH3-64 hash of its bytes, the receiver checks it on arrival, and a damaged bucket or
a sender that stops mid-sync ends the receiving side with an error naming the sync and the bucket."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import xxhash

from raylign.rollout.buckets import (
    BufferPool,
    checksum_from_int64,
    checksum_to_int64,
    combine_checksums,
    iter_packed_buckets,
    pack_bucket,
)
from raylign.rollout.sync_wire import IncomingSync, WeightSyncCorrupted, _Broadcasts, send_buckets
from raylign.rollout.weight_sync import join_group_as_receiver, make_gloo_group, open_group_as_sender

HOST = "127.0.0.1"
BUCKET_BYTES = 20_000  # each 64x64 fp32 tensor (16 KiB) travels in a bucket of its own


def _weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(f"layers.{i}.weight", torch.randn(64, 64, generator=generator)) for i in range(4)]


def _pair(timeout_s: float):
    """A sender group (rank 0) and a receiver group (rank 1) of one 2-rank gloo group."""
    store, port = open_group_as_sender(HOST, 2, timeout_s)
    joined: dict = {}
    thread = threading.Thread(target=lambda: joined.update(pair=join_group_as_receiver(HOST, port, 1, 2, timeout_s)))
    thread.start()
    sender = make_gloo_group(store, 0, 2, timeout_s)
    thread.join(timeout_s)
    return store, sender, joined["pair"]


class Receiving:
    """Iterates an :class:`IncomingSync` on a thread of its own; keeps what arrived and how it ended."""

    def __init__(self, group, version: int | None):
        self.incoming = IncomingSync(group, version)
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            for name, tensor in self.incoming:
                self.names.append(name)
                self.tensors.append(tensor.clone())
        except BaseException as err:  # the test looks at it
            self.error = err

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the receiver did not finish within {timeout_s} s"


def test_a_packed_bucket_carries_the_xxh3_64_of_its_header_then_its_payload():
    bucket = pack_bucket(_weights()[:2])
    expected = xxhash.xxh3_64_intdigest(bucket.header_bytes() + bytes(bucket.buffer.numpy()))
    assert bucket.checksum == expected


def test_a_syncs_checksum_is_the_xxh3_64_of_its_bucket_checksums_in_order():
    high = 0xFEDCBA9876543210
    assert combine_checksums([1, high]) == xxhash.xxh3_64_intdigest(
        b"\x01\x00\x00\x00\x00\x00\x00\x00\x10\x32\x54\x76\x98\xba\xdc\xfe"
    )
    assert combine_checksums([1, 2]) != combine_checksums([2, 1])


def test_a_checksum_travels_as_the_int64_with_the_same_bits():
    for checksum in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 0xFEDCBA9876543210):
        value = checksum_to_int64(checksum)
        assert -(1 << 63) <= value < 1 << 63
        assert torch.tensor([value], dtype=torch.int64).numpy().view("uint64")[0] == checksum
        assert checksum_from_int64(value) == checksum


def test_a_clean_sync_arrives_whole_and_both_sides_agree_on_its_checksum():
    store, sender, (_, receiver) = _pair(30)
    weights = _weights()
    receiving = Receiving(receiver, version=3)
    sent = send_buckets([sender], iter_packed_buckets(weights, BUCKET_BYTES))
    receiving.join(30)
    assert receiving.error is None
    assert receiving.names == [name for name, _ in weights]
    assert all(torch.equal(got, tensor) for got, (_, tensor) in zip(receiving.tensors, weights))
    # Computed here from the raw bytes: XXH3-64 of header + payload per bucket, then of the four hashes.
    hashes = [
        xxhash.xxh3_64_intdigest(b.header_bytes() + bytes(b.buffer.numpy()))
        for b in iter_packed_buckets(weights, BUCKET_BYTES)
    ]
    assert any(h >= 1 << 63 for h in hashes)  # one crossed the wire as a negative int64
    expected = xxhash.xxh3_64_intdigest(b"".join(h.to_bytes(8, "little") for h in hashes))
    assert (sent.num_buckets, sent.checksum) == (4, expected)
    assert (receiving.incoming.num_buckets, receiving.incoming.checksum) == (4, expected)


def _flip_a_byte_of_bucket(index: int, buckets):
    """The buckets as packed (checksums taken), one byte of bucket ``index``'s payload inverted on the way."""
    for position, bucket in enumerate(buckets):
        if position == index:
            middle = bucket.buffer.numel() // 2
            bucket.buffer[middle] = 255 - int(bucket.buffer[middle])
        yield bucket


def test_a_flipped_byte_stops_the_receiver_naming_sync_and_bucket_and_the_sender_still_finishes():
    store, sender, (_, receiver) = _pair(30)
    weights = _weights()
    receiving = Receiving(receiver, version=7)
    started = time.monotonic()
    sent = send_buckets([sender], _flip_a_byte_of_bucket(2, iter_packed_buckets(weights, BUCKET_BYTES)))
    receiving.join(30)
    # The receiver took in the rest of the sync, so the sender finished at once, not at the 30 s timeout.
    assert time.monotonic() - started < 10 and sent.num_buckets == 4
    assert isinstance(receiving.error, WeightSyncCorrupted)
    assert "weight sync 7: bucket 2 reached this engine damaged" in str(receiving.error)
    assert "resume from the last checkpoint" in str(receiving.error)
    assert receiving.names == [name for name, _ in weights[:2]]  # nothing of the damaged bucket was handed on


def test_a_sender_that_stops_mid_sync_fails_the_receiver_at_the_group_timeout_naming_the_bucket():
    store, sender, (_, receiver) = _pair(3)
    receiving = Receiving(receiver, version=4)
    buckets = iter_packed_buckets(_weights(), BUCKET_BYTES)
    started = time.monotonic()
    out = _Broadcasts([sender], None)
    out.finish(out.start(next(buckets)))  # one bucket, then silence
    receiving.join(30)
    assert 2 < time.monotonic() - started < 20
    assert isinstance(receiving.error, TimeoutError)
    message = str(receiving.error)
    assert "weight sync 4: receiving the sizes of bucket 1 failed" in message
    assert "rollout.sync_timeout_s" in message
    assert receiving.names == ["layers.0.weight"]


@pytest.mark.parametrize("version, label", [(None, "weight sync: bucket 0"), (12, "weight sync 12: bucket 0")])
def test_the_error_names_the_sync_when_its_version_is_known(version, label):
    store, sender, (_, receiver) = _pair(30)
    receiving = Receiving(receiver, version=version)
    send_buckets([sender], _flip_a_byte_of_bucket(0, iter_packed_buckets(_weights(), BUCKET_BYTES)))
    receiving.join(30)
    assert label in str(receiving.error)


def test_a_receiver_reuses_a_buffer_only_once_nothing_refers_to_its_tensors():
    store, sender, (_, receiver) = _pair(30)
    weights, pool = _weights(), BufferPool(keep=4)
    # First sync: the consumer keeps every tensor it was handed (as vLLM keeps a layer's until the layer
    # is complete), so each bucket needs a buffer of its own, and none is overwritten while held.
    held: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: held.extend(t for _, t in IncomingSync(receiver, 1, pool=pool)))
    thread.start()
    send_buckets([sender], iter_packed_buckets(weights, BUCKET_BYTES))
    thread.join(30)
    assert pool.allocated == 4
    assert all(torch.equal(got, tensor) for got, (_, tensor) in zip(held, weights))
    # Once they are let go, the next sync is received into the same four buffers: no new memory.
    addresses = {t.untyped_storage().data_ptr() for t in held}
    held.clear()
    second = [(name, tensor + 1) for name, tensor in weights]
    got: list[tuple[torch.Tensor, int]] = []
    thread = threading.Thread(
        target=lambda: got.extend(
            (t.clone(), t.untyped_storage().data_ptr()) for _, t in IncomingSync(receiver, 2, pool=pool)
        )
    )
    thread.start()
    send_buckets([sender], iter_packed_buckets(second, BUCKET_BYTES))
    thread.join(30)
    assert pool.allocated == 4
    assert {address for _, address in got} <= addresses
    assert all(torch.equal(tensor, expected) for (tensor, _), (_, expected) in zip(got, second))


def test_waited_s_is_the_time_the_consumer_waited_for_buckets():
    store, sender, (_, receiver) = _pair(30)
    delay_s = 0.25

    def slow_buckets():  # the sender takes delay_s before each of the four buckets
        for bucket in iter_packed_buckets(_weights(), BUCKET_BYTES):
            time.sleep(delay_s)
            yield bucket

    started = time.monotonic()  # before the receiver's thread starts its clock
    receiving = Receiving(receiver, version=1)
    send_buckets([sender], slow_buckets())
    receiving.join(30)
    elapsed = time.monotonic() - started
    assert receiving.error is None
    assert 4 * delay_s * 0.9 <= receiving.incoming.waited_s <= elapsed
