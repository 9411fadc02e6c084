"""The one training-engine interface that every trainer drives.

A trainer never touches optimizers, sharding or checkpoint formats directly: it calls
``engine.module(...)`` for the forward pass, ``engine.backward(loss)`` per micro-batch and
``engine.step()`` once per optimizer step. Backends: ``local``, ``fsdp2``, ``deepspeed``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch


class TrainEngine(ABC):
    """Contract shared by all backends.

    Gradient accumulation is the caller's business: it calls ``backward`` on each
    micro-batch loss (already scaled as it wants the gradients summed) and ``step`` once.
    """

    module: torch.nn.Module  # the (wrapped) model to run forward passes through
    rank: int
    world_size: int
    device: torch.device

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of ``loss``; gradients are summed over calls until ``step``."""

    @abstractmethod
    def step(self) -> dict[str, float]:
        """Clip, optimizer step, scheduler step, zero grads. Returns {'grad_norm', 'lr'}."""

    @abstractmethod
    def save_checkpoint(self, directory: str | Path, client_state: dict[str, Any]) -> None:
        """Write weights, optimizer, scheduler, RNG and ``client_state`` into ``directory``.

        Collective: every rank calls it. ``directory`` is final only once complete
        (see :mod:`raylign.engine.checkpoint` for the atomic protocol).
        """

    @abstractmethod
    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote; returns the ``client_state``."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded model weights (HF names, LoRA merged) on rank 0; empty dict elsewhere."""

    @abstractmethod
    def export_hf(self, directory: str | Path, tokenizer: Any | None = None) -> None:
        """Save a plain HF folder (config, safetensors, tokenizer) that transformers and vLLM load."""

    def offload(self) -> None:
        """Move parameters and optimizer state to the CPU (no-op where they already are)."""

    def onload(self) -> None:
        """Undo :meth:`offload`."""

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()
