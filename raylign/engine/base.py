"""The one training-engine interface that every trainer drives.

A trainer never touches optimizers, sharding or checkpoint formats directly: it calls
``engine.module(...)`` for the forward pass, ``engine.backward(loss)`` per micro-batch and
``engine.step()`` once per optimizer step. Backends: ``local``, ``fsdp2``, ``deepspeed``.

Gradient semantics are the same on every backend: gradients of all ``backward`` calls since
the last ``step`` are summed, and data-parallel ranks average their sums. So if each rank
scales its micro-batch losses to be its share of the mean, the update equals the one a single
process computes on the whole batch.
"""

from __future__ import annotations

import copy
import math
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from raylign.engine import checkpoint as ckpt
from raylign.engine.distributed import (
    all_reduce_scalars,
    barrier,
    broadcast_named_tensors,
    get_world_size,
    is_main_process,
)
from raylign.engine.export import (
    ADAPTER_FOLDER,
    adapter_config,
    adapter_weights,
    base_hf_model,
    is_adapter_weight,
    merge_adapter_folder,
    to_hf_state_dict,
    without_tied_output,
    write_adapter_folder,
    write_hf_folder,
)
from raylign.engine.optim import current_lr
from raylign.models.loading import is_quantized

SCHEDULER_FILE = "scheduler.pt"


def floating_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point parameters (the first one found)."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    raise ValueError(f"{type(model).__name__} has no floating-point parameters")


class TrainEngine(ABC):
    """Contract shared by all backends.

    Gradient accumulation is the caller's business: it calls ``backward`` on each
    micro-batch loss (already scaled as it wants the gradients summed) and ``step`` once.
    Every method that touches weights is collective: all ranks call it, in the same order.
    """

    backend_name: str
    module: torch.nn.Module  # the (wrapped) model to run forward passes through
    rank: int
    world_size: int
    device: torch.device
    optimizer: Any  # torch optimizer, or DeepSpeed's wrapper around one
    scheduler: torch.optim.lr_scheduler.LRScheduler
    model_dtype: torch.dtype  # dtype the caller built the model in; exports and weight sync use it
    max_grad_norm: float  # 0 disables clipping

    # ------------------------------------------------------------------ training

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of ``loss``; gradients are summed over calls until ``step``."""

    @abstractmethod
    def _clip_and_update(self, max_grad_norm: float, update: bool) -> tuple[float, bool]:
        """Measure the global gradient norm and clip to it; apply the optimizer if ``update`` and
        the norm is finite; zero grads. Returns the pre-clip norm and whether it updated."""

    def step(self, finite_loss: bool = True) -> dict[str, float]:
        """Clip, optimizer step, scheduler step, zero grads. Returns {'grad_norm', 'lr', 'skipped'}.

        ``lr`` is the rate this step used; ``grad_norm`` the global L2 norm before clipping. The
        update is skipped (gradients dropped; weights, optimizer state and schedule untouched)
        when some rank's loss was not finite (``finite_loss`` is this rank's) or the gradient
        norm is not finite; ``skipped`` is then 1. A backend that cannot skip (DeepSpeed) has
        updated by then: that raises, since its weights are no longer valid.
        """
        lr = current_lr(self.optimizer)
        (finite_everywhere,) = all_reduce_scalars([float(finite_loss)], op="min")
        grad_norm, updated = self._clip_and_update(self.max_grad_norm, update=finite_everywhere == 1.0)
        if updated and not (finite_everywhere == 1.0 and math.isfinite(grad_norm)):
            raise FloatingPointError(
                f"the {self.backend_name} engine applied an update with a non-finite loss or gradient norm "
                f"({grad_norm}) and cannot skip one: the weights are no longer valid. Resume from the newest "
                "checkpoint with a lower optim.lr, or use engine.backend: fsdp2, which skips such steps"
            )
        if updated:
            self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr, "skipped": float(not updated)}

    # ------------------------------------------------------------------ checkpoints

    @abstractmethod
    def _save_engine_state(self, directory: Path) -> None:
        """Collective: weights and optimizer state in this backend's format, into ``directory``."""

    @abstractmethod
    def _load_engine_state(self, directory: Path) -> None:
        """Collective: restore what :meth:`_save_engine_state` wrote."""

    def save_checkpoint(self, directory: str | Path, client_state: dict[str, Any]) -> None:
        """Write weights, optimizer, scheduler, RNG and ``client_state`` into ``directory``.

        Collective: every rank calls it. ``directory`` is final only once complete
        (see :mod:`raylign.engine.checkpoint` for the atomic protocol).
        """
        meta = {"backend": self.backend_name, "world_size": self.world_size, "format_version": 1}
        ckpt.write_atomically(directory, lambda temp: self._write_checkpoint_files(temp, client_state), meta)

    def _write_checkpoint_files(self, temp: Path, client_state: dict[str, Any]) -> None:
        self._save_engine_state(temp)
        if is_main_process():
            torch.save(self.scheduler.state_dict(), temp / SCHEDULER_FILE)
        ckpt.save_rank_state(temp, client_state)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote; returns the ``client_state``.

        Needs the same backend and world size as the run that saved it.
        """
        directory = Path(directory)
        meta = ckpt.read_meta(directory)
        ckpt.check_world_size(directory, meta, self.backend_name)
        self._load_engine_state(directory)
        self.scheduler.load_state_dict(ckpt.load_file(directory, SCHEDULER_FILE))
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
        barrier()
        # Last, so that nothing above consumes random numbers after the restore.
        return ckpt.load_rank_state(directory)

    # ------------------------------------------------------------------ weights out

    @abstractmethod
    def _gather_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: unsharded weights under the wrapped model's own names, on rank 0 (CPU)."""

    @property
    def hf_model(self) -> torch.nn.Module:
        """The caller's model (a transformers model, possibly wrapped by PEFT), without engine wrappers."""
        return self.module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded model weights (HF names, LoRA merged) on rank 0; empty dict elsewhere.

        Collective. Floating tensors come in ``model_dtype``, the dtype the model was built in.
        """
        raw = self._gather_state_dict()
        if not is_main_process():
            return {}
        return to_hf_state_dict(raw, self.hf_model, self.model_dtype)

    def iter_full_state(self, every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync sends: :meth:`full_state_dict` without a tied output head (it travels
        once, as the embedding), one tensor at a time, on rank 0, nothing elsewhere; with
        ``every_rank``, on every rank (what colocated engines load, one in each rank's process).

        Collective: every rank iterates it to the end, in step with the others. Backends that can
        gather a parameter or a layer at a time (FSDP2, DeepSpeed) hand each tensor out before
        gathering the next; this default gathers the whole model on rank 0 first, and with
        ``every_rank`` broadcasts it from there a tensor at a time."""
        state = without_tied_output(self.full_state_dict(), self.hf_model)
        if every_rank and get_world_size() > 1:
            yield from broadcast_named_tensors(state.items(), self.device)
        else:
            yield from state.items()

    def adapter_state_dict(self, every_rank: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A LoRA model's adapter weights, unsharded, under PEFT's saved names in ``model_dtype``,
        and its ``adapter_config.json`` values: a PEFT adapter folder's content, on rank 0 (no
        weights elsewhere), or with ``every_rank`` on every rank. Collective; gathers the adapter's
        tensors only."""
        raw = self._gather_adapter_state_dict(every_rank)
        config = adapter_config(self.hf_model)
        if not (every_rank or is_main_process()):
            return {}, config
        return adapter_weights(raw, self.hf_model, self.model_dtype), config

    def _gather_adapter_state_dict(self, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """The adapter's tensors of :meth:`_gather_state_dict` (on rank 0, or with ``every_rank``
        broadcast from there); backends that can gather them alone do."""
        adapter = {k: v for k, v in self._gather_state_dict().items() if is_adapter_weight(k)}
        if every_rank and get_world_size() > 1:
            return dict(broadcast_named_tensors(adapter.items(), self.device))
        return adapter

    def write_base_folder(self, directory: str | Path, tokenizer: Any | None = None) -> None:
        """A LoRA model's base, without its adapters, as a plain HF folder: what rollout engines that
        serve the adapters on top start from. A 4-bit base (QLoRA) is written as the values its
        layers compute with, dequantised, so an engine computes what this model computes, not what
        the full-precision original would. Collective; rank 0 writes."""
        raw = self._gather_state_dict()
        if is_main_process():
            base = to_hf_state_dict(raw, self.hf_model, self.model_dtype, merge=False)
            write_hf_folder(directory, base, self.hf_model, self.model_dtype, tokenizer)
        barrier()

    def export_hf(self, directory: str | Path, tokenizer: Any | None = None) -> None:
        """Save a plain HF folder (config, safetensors, tokenizer) that transformers and vLLM load.
        A LoRA model's folder holds the merged weights, and its adapter alone as a PEFT adapter folder
        in ``adapter/`` (for vLLM's LoRA serving, or ``raylign merge-lora`` onto another base).

        Collective; rank 0 writes.
        """
        if is_quantized(self.hf_model):
            self._export_on_full_base(Path(directory), tokenizer)
            return
        state_dict = self.full_state_dict()
        adapter = self.adapter_state_dict() if hasattr(self.hf_model, "peft_config") else None
        if is_main_process():
            write_hf_folder(directory, state_dict, self.hf_model, self.model_dtype, tokenizer)
            if adapter is not None:
                write_adapter_folder(Path(directory) / ADAPTER_FOLDER, *adapter)
        barrier()

    def _export_on_full_base(self, directory: Path, tokenizer: Any | None) -> None:
        """:meth:`export_hf` of a model with a 4-bit base (QLoRA): the adapter is merged into the base
        model's own weights, read again from its folder in the dtype the 4-bit layers computed in, not
        into the 4-bit values (merging there would write the quantisation error into the export)."""
        tensors, adapter_cfg = self.adapter_state_dict()
        if is_main_process():
            base = base_hf_model(self.hf_model)
            quantizer = getattr(base, "hf_quantizer", None)
            dtype = getattr(getattr(quantizer, "quantization_config", None), "bnb_4bit_compute_dtype", None)
            dtype = dtype or self.model_dtype
            config = copy.deepcopy(base.config)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            with tempfile.TemporaryDirectory() as scratch:
                staged = write_adapter_folder(Path(scratch) / ADAPTER_FOLDER, tensors, adapter_cfg)
                merged = merge_adapter_folder(staged, config._name_or_path, type(base), config, dtype)
                write_hf_folder(directory, merged.state_dict(), merged, dtype, tokenizer)
            write_adapter_folder(directory / ADAPTER_FOLDER, tensors, adapter_cfg)
        barrier()

    # ------------------------------------------------------------------ colocation

    def offload(self, keep_weights: bool = False) -> None:  # noqa: B027 - a no-op is right where state stays on the CPU
        """Move parameters and optimizer state to the CPU (no-op where they already are). With
        ``keep_weights`` the model's weights stay (a weight sync gathers them next); a later call
        without it moves them too."""

    def onload(self) -> None:  # noqa: B027
        """Undo :meth:`offload`."""

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()
