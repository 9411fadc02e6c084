"""Packing named tensors into size-bounded flat byte buckets, and back.

A weight sync moves thousands of tensors; sending them one by one costs one round trip
each. Instead consecutive tensors are packed into one flat ``uint8`` buffer of at most
``bucket_bytes`` (a tensor larger than the bound travels alone in its own bucket) and the
receiver rebuilds each tensor as a view into that buffer from the metadata
(name, dtype, shape, byte offset).

Buffers come from a :class:`BufferPool`, which hands a buffer out again only once no tensor
refers to its memory: the receiver's views stay valid while later buckets are received (vLLM
keeps references until a layer is complete), and a sender's bucket is not overwritten while it is
being broadcast. Reuse matters: the first write to new memory costs a page fault per 4 KiB page
(measured on one core: 32 MiB copied into a new buffer 14 ms, 2.3 GB/s; into a used one 1.6 ms,
21 GB/s; glibc returns buffers this large to the kernel when they are freed).

Each bucket carries the XXH3-64 hash of its bytes (header, then payload) as packed; the receiver
computes it again on what arrived (:func:`bucket_checksum`), and a sync's checksum is the XXH3-64
of its buckets' checksums in order (:func:`combine_checksums`). A hash rather than a sum: a sum of
int64 words misses words that trade places; any change to a bucket's bytes changes its 64-bit
hash but for a 2^-64 chance. XXH3 rather than CRC-32: both sides hash every byte of every sync, and
on one core (2-core AMD EPYC, AVX2, zlib 1.2.13, 32 MiB) XXH3-64 ran at 15.9 GB/s and CRC-32 at
3.9 GB/s, against 6.6 GB/s to pack the bucket.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import xxhash

from raylign.buffers import storage_users

ALIGN_BYTES = 16  # every tensor starts at a multiple of this, so a uint8 slice can be viewed as any dtype


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # byte offset in the bucket buffer
    nbytes: int


@dataclass
class Bucket:
    metas: list[TensorMeta]
    buffer: torch.Tensor  # 1-D uint8, on the CPU
    checksum: int = 0  # bucket_checksum(header_bytes(), buffer) when packed: unsigned, 64 bits

    def header_bytes(self) -> bytes:
        return pickle.dumps([(m.name, m.dtype, m.shape, m.offset, m.nbytes) for m in self.metas])


class BufferPool:
    """Flat uint8 CPU buffers for buckets, reused once nothing refers to them.

    :meth:`take` returns a view of ``nbytes`` into a kept buffer that no tensor refers to any more
    (counted on the buffer's storage, so views of views count too), or into a new one as large as
    the largest asked for so far; at most ``keep`` buffers are kept. Where torch cannot count a
    storage's users every call gets new memory."""

    def __init__(self, keep: int = 3):
        self.keep = keep
        self._buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, its storage's users when idle)
        self._largest = 0
        self.allocated = 0  # new buffers made (for tests and figures)

    def take(self, nbytes: int) -> torch.Tensor:
        self._largest = max(self._largest, nbytes)
        for buffer, idle in self._buffers:
            if buffer.numel() >= nbytes and storage_users(buffer) == idle:
                return buffer[:nbytes]
        buffer = torch.empty(self._largest, dtype=torch.uint8)
        self.allocated += 1
        idle = storage_users(buffer)
        if idle is not None:
            if len(self._buffers) >= self.keep:  # forget the smallest idle buffer, or keep this one out
                free = [i for i, (b, n) in enumerate(self._buffers) if storage_users(b) == n]
                if free:
                    del self._buffers[min(free, key=lambda i: self._buffers[i][0].numel())]
            if len(self._buffers) < self.keep:
                self._buffers.append((buffer, idle))
        return buffer[:nbytes]


def bucket_checksum(header: bytes, payload: torch.Tensor) -> int:
    """XXH3-64 of a bucket's header bytes followed by its flat uint8 payload (no copy of the payload)."""
    digest = xxhash.xxh3_64(header)
    digest.update(payload.numpy())
    return digest.intdigest()


def combine_checksums(checksums: Iterable[int]) -> int:
    """The checksum of a whole sync: XXH3-64 of its buckets' checksums (8 bytes each, little-endian), in order."""
    return xxhash.xxh3_64_intdigest(b"".join(int(c).to_bytes(8, "little") for c in checksums))


def checksum_to_int64(checksum: int) -> int:
    """An unsigned 64-bit checksum as the signed int64 with the same bits (it travels in an int64 tensor)."""
    return checksum - (1 << 64) if checksum >= 1 << 63 else checksum


def checksum_from_int64(value: int) -> int:
    """The unsigned checksum whose bits the int64 ``value`` carries (inverse of :func:`checksum_to_int64`)."""
    return value & ((1 << 64) - 1)


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight bucket names an unknown dtype {name!r}")
    return dtype


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def group_into_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups whose aligned sizes add up to at most ``bucket_bytes``.

    Lazy: holds only the current group, so a generator of gathered weights is never
    materialised in full. A tensor larger than the bound forms a group by itself.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    group: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r}: expected a tensor, got {type(tensor).__name__}")
        size = _aligned(_tensor_nbytes(tensor))
        if group and used + size > bucket_bytes:
            yield group
            group, used = [], 0
        group.append((name, tensor))
        used += size
    if group:
        yield group


def pack_bucket(named_tensors: list[tuple[str, torch.Tensor]], pool: BufferPool | None = None) -> Bucket:
    """Copy ``named_tensors`` into one CPU uint8 buffer (from ``pool``, else new) and record where each lies."""
    metas: list[TensorMeta] = []
    offset = 0
    for name, tensor in named_tensors:
        nbytes = _tensor_nbytes(tensor)
        metas.append(TensorMeta(name, _dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes))
        offset += _aligned(nbytes)
    buffer = torch.empty(offset, dtype=torch.uint8) if pool is None else pool.take(offset)
    for meta, (_, tensor) in zip(metas, named_tensors):
        if meta.nbytes:
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[meta.offset : meta.offset + meta.nbytes].copy_(flat)
    bucket = Bucket(metas, buffer)
    bucket.checksum = bucket_checksum(bucket.header_bytes(), buffer)
    return bucket


def iter_packed_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, pool: BufferPool | None = None
) -> Iterator[Bucket]:
    """The buckets of ``named_tensors``, packed one at a time into buffers of ``pool`` (a new pool
    for this iteration when None)."""
    pool = pool or BufferPool()
    for group in group_into_buckets(named_tensors, bucket_bytes):
        yield pack_bucket(group, pool)


def metas_from_header(header: bytes) -> list[TensorMeta]:
    return [
        TensorMeta(name, dtype, tuple(shape), offset, nbytes)
        for name, dtype, shape, offset, nbytes in pickle.loads(header)
    ]


def unpack_bucket(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``bucket`` as views into its buffer (no copy), in packing order."""
    out = []
    for meta in bucket.metas:
        if meta.offset + meta.nbytes > bucket.buffer.numel():
            raise ValueError(f"weight bucket is truncated: {meta.name!r} ends past the buffer")
        raw = bucket.buffer[meta.offset : meta.offset + meta.nbytes]
        out.append((meta.name, raw.view(_dtype_from_name(meta.dtype)).view(meta.shape)))
    return out
