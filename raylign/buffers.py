"""CPU memory used again once no tensor refers to it: fresh pages cost a page fault each on first
write, which made copies and gloo transfers into new tensors several times slower than into used
ones (``benchmarks/README.md``)."""

from __future__ import annotations

import torch


def storage_users(tensor: torch.Tensor) -> int | None:
    """How many tensors share ``tensor``'s memory (None where this torch cannot say)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else int(use_count(tensor.untyped_storage()._cdata))


class ReusedBuffers:
    """Memory for whole tensors that is used again once nobody holds it. Writing into fresh memory
    costs a page fault per 4 KiB page: on the 2-core test machine a gloo broadcast into a new
    128 MiB tensor took three times as long as into one used before (``benchmarks/README.md``),
    and every gather of a weight sync made its whole tensors anew. One buffer is kept per shape
    and dtype (a model's few distinct weight shapes: for SmolLM2 about a fifth of the model)."""

    def __init__(self) -> None:
        # shape and dtype -> (the kept tensor, its storage's users when nothing else holds it)
        self._kept: dict[tuple[torch.Size, torch.dtype], tuple[torch.Tensor, int | None]] = {}

    def idle(self, shape: torch.Size, dtype: torch.dtype) -> bool:
        """Whether the next ``take`` of ``shape`` and ``dtype`` hands back memory used before: a
        buffer is kept for them and nothing made from it is alive. A collective may hold its
        tensor a moment after it returned (gloo's worker thread lets go on its own schedule)."""
        kept = self._kept.get((shape, dtype))
        return kept is not None and kept[1] is not None and storage_users(kept[0]) == kept[1]

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` (contents undefined): the kept one when no tensor made
        from it is alive any more, else a new one, kept from then on. Hand out views, never the
        kept tensor itself: views are what show that it is still in use. Where torch cannot count
        a storage's users every call gets new memory."""
        if self.idle(shape, dtype):
            return self._kept[(shape, dtype)][0]
        tensor = torch.empty(shape, dtype=dtype)
        self._kept[(shape, dtype)] = (tensor, storage_users(tensor))
        return tensor
