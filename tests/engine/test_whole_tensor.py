"""``whole_tensor``, the gather behind FSDP2's weight stream on CPU: one gloo broadcast per rank into
its rows gives each rank exactly what ``DTensor.full_tensor`` gives, for rows that split evenly over
the ranks, unevenly, and over fewer rows than ranks, in fp32 and bf16."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.spawned_ranks import import_worker, spawn_and_join

worker = import_worker(__file__, "whole_tensor_worker")


@pytest.mark.distributed
def test_broadcast_gather_equals_the_full_tensor_on_every_rank():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))  # the spawned ranks import the worker by name
        spawn_and_join(worker.run_rank, (), worker.WORLD_SIZE, 300, "whole_tensor ranks")


def test_reused_buffers_hand_back_memory_only_once_nothing_holds_it():
    import torch

    from raylign.buffers import ReusedBuffers

    buffers = ReusedBuffers()
    first = buffers.take(torch.Size([4, 3]), torch.float32).view(4, 3)
    pointer = first.data_ptr()
    held = first.detach()  # a view the caller keeps: the memory is still in use
    del first
    second = buffers.take(torch.Size([4, 3]), torch.float32).view(4, 3)
    assert second.data_ptr() != pointer
    del held, second
    # nothing made from the newest buffer is alive: it comes back; another dtype or shape is its own
    third = buffers.take(torch.Size([4, 3]), torch.float32)
    assert third.data_ptr() == buffers.take(torch.Size([4, 3]), torch.float32).data_ptr()
    assert buffers.take(torch.Size([4, 3]), torch.bfloat16).dtype == torch.bfloat16
    assert buffers.take(torch.Size([12]), torch.float32).data_ptr() != third.data_ptr()
