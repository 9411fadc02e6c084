"""Code run inside the 3 spawned gloo ranks of ``test_whole_tensor.py``."""

from __future__ import annotations

import time

import torch

from tests.spawned_ranks import as_gloo_rank

WORLD_SIZE = 3
# Rows that split evenly over 3 ranks, unevenly, and fewer rows than ranks (the last rank holds none).
SHAPES = [(6, 4), (7, 3), (2, 5), (1,), (4,)]


def run_rank(rank: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from raylign.buffers import ReusedBuffers
    from raylign.engine.fsdp2 import whole_tensor

    as_gloo_rank(rank, WORLD_SIZE, port)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            original = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) * 10 + shape[0]))
            original = original.to(dtype)
            sharded = torch.nn.Parameter(distribute_tensor(original, mesh, [Shard(0)]))
            whole = whole_tensor(sharded)
            assert torch.equal(whole, original), (rank, dtype, shape)
            assert torch.equal(whole, sharded.full_tensor()), (rank, dtype, shape)
            assert whole.dtype == dtype and not whole.requires_grad
    # Into reused memory: a second gather while the first result is still held gets memory of its
    # own; once that is let go, the next gather of the shape writes over it.
    buffers = ReusedBuffers()
    a, b = (torch.nn.Parameter(distribute_tensor(torch.full((7, 3), v), mesh, [Shard(0)])) for v in (1.0, 2.0))
    held = whole_tensor(a, buffers)
    again = whole_tensor(b, buffers)
    assert torch.equal(held, torch.full((7, 3), 1.0)) and torch.equal(again, torch.full((7, 3), 2.0))
    pointer = again.data_ptr()
    del again
    # gloo's worker thread lets go of the last broadcast's tensor on its own schedule, a moment
    # after the call returned: wait for that, bounded, before asserting the reuse.
    deadline = time.monotonic() + 30
    while not buffers.idle(torch.Size([7, 3]), torch.float32):
        assert time.monotonic() < deadline, f"rank {rank}: the gathered buffer was still held after 30 s"
        time.sleep(0.01)
    assert whole_tensor(a, buffers).data_ptr() == pointer
    # Any other layout is left to DTensor's own gather.
    replicated = distribute_tensor(torch.arange(6.0), mesh, [Replicate()])
    assert torch.equal(whole_tensor(replicated), torch.arange(6.0))
