"""A resumable batch sampler and the split of a global batch over data-parallel ranks and micro-batches.

Every rank runs the same :class:`ResumableSampler` (same arguments, same state) and takes
its own share of each global batch with :func:`rank_micro_batches`, so no rank needs to
tell another which samples it has.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


class ResumableSampler:
    """Global batches of sample indices, reshuffled every epoch, resumable from a small state.

    Epoch ``e`` visits the samples in the order ``permutation(seed + e)`` (or in order when
    ``shuffle`` is False), cut into batches of ``batch_size``; with ``drop_last`` the
    incomplete last batch is left out. Iterating yields the remaining batches of the current
    epoch and then moves to the next epoch, so ``for epoch ...: for batch in sampler:`` works,
    and a sampler that loads another's ``state_dict()`` continues exactly where it stopped.
    """

    def __init__(self, num_samples: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if num_samples < 1:
            raise ValueError("the sampler needs at least one sample")
        if drop_last and num_samples < batch_size:
            raise ValueError(
                f"{num_samples} samples make no batch of {batch_size} with drop_last; use a smaller batch or more data"
            )
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.batches_done = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng(self.seed + epoch).permutation(self.num_samples)

    def _next_epoch_if_finished(self) -> None:
        if self.batches_done >= len(self):
            self.epoch += 1
            self.batches_done = 0

    def __iter__(self) -> Iterator[list[int]]:
        self._next_epoch_if_finished()
        order = self.epoch_order(self.epoch)
        while self.batches_done < len(self):
            start = self.batches_done * self.batch_size
            batch = order[start : start + self.batch_size].tolist()
            self.batches_done += 1  # counted before the yield: the state describes what was handed out
            yield batch
        self._next_epoch_if_finished()

    def state_dict(self) -> dict[str, int]:
        """Position after the batches handed out so far; a finished epoch reads as the next one's start."""
        epoch, done = self.epoch, self.batches_done
        if done >= len(self):
            epoch, done = epoch + 1, 0
        return {
            "epoch": epoch,
            "batches_done": done,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The order depends on all four: with another, the rest of the epoch would repeat some samples
        # and skip others. (A state saved before shuffle and seed were recorded checks the sizes only.)
        mine = {
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]}, this sampler has {key}={value}; "
                    "resuming would visit different samples (the data's shuffle and seed settings must match "
                    "the run resumed)"
                )
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        if epoch < 0 or not 0 <= done <= len(self):
            raise ValueError(f"invalid sampler state {state} for {len(self)} batches per epoch")
        self.epoch, self.batches_done = epoch, done


def shard_for_rank(batch: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of a global batch; sizes differ by at most one (lower ranks larger)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    base, extra = divmod(len(batch), world_size)
    start = rank * base + min(rank, extra)
    return list(batch[start : start + base + (rank < extra)])


def split_micro_batches(indices: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive chunks of ``micro_batch_size`` (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
    return [list(indices[i : i + micro_batch_size]) for i in range(0, len(indices), micro_batch_size)]


def rank_micro_batches(batch: Sequence[int], rank: int, world_size: int, micro_batch_size: int) -> list[list[int]]:
    """This rank's share of a global batch, cut into micro-batches for gradient accumulation."""
    return split_micro_batches(shard_for_rank(batch, rank, world_size), micro_batch_size)
