"""Pinned host copies of device tensors, for the colocated offload of trainer state.

A device-to-host copy into ordinary (pageable) memory goes through a driver staging buffer: on an
H100 machine ``benchmarks/gpu_check.py`` measured 2.0 GB/s moving a 0.5B model's optimizer state
that way. Into page-locked (pinned) memory the copy runs at the link's speed. Pinning is slow in
its own right (the kernel locks every page), so each tensor's buffer is pinned once and reused at
every offload after it: the host memory held is what an offload moves, kept between offloads.

Only plain CUDA tensors are stashed. Anything else (a tensor already on the CPU, a ``DTensor``,
whose local shard a copy cannot replace without rebuilding the tensor) moves with ``.to("cpu")``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class HostStash:
    """One pinned host buffer per key, reused from offload to offload."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def put(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` copied to host memory: into ``key``'s pinned buffer where it can be, else by ``.to``."""
        if not tensor.is_cuda or isinstance(tensor, DTensor):
            return tensor.to("cpu")
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.buffers[key] = buffer
        buffer.copy_(tensor)  # blocking: nothing may read the buffer, or reuse the source, before it lands
        return buffer

    def move(self, key: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` on ``device``: through ``key``'s pinned buffer when that is the CPU (see :meth:`put`)."""
        return self.put(key, tensor) if device.type == "cpu" else tensor.to(device)

    def move_module(self, module: torch.nn.Module, device: torch.device, prefix: str = "") -> None:
        """``module`` to ``device``; to the CPU with every parameter (and gradient) through the stash, its
        buffers (rotary frequencies) and anything else by ``.to``."""
        if device.type == "cpu":
            with torch.no_grad():
                for name, param in module.named_parameters():
                    param.data = self.put(f"{prefix}{name}", param.data)
                    if param.grad is not None:
                        param.grad = self.put(f"{prefix}{name}.grad", param.grad)
        module.to(device)

    @property
    def nbytes(self) -> int:
        """Host memory the pinned buffers hold."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
