"""Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``) for weight sync.

A LoRA policy's adapter weights (``rollout.lora_sync: adapter``) arrive the same way; the first
worker writes them as a PEFT adapter folder, which the engine then adds as a vLLM LoRA adapter.

vLLM mixes this class into its worker class, in whatever process the worker runs
(the engine actor's own process when tensor_parallel_size is 1, spawned processes
otherwise), and the engine calls these methods through ``llm.collective_rpc``. This
module must stay importable there: no heavy imports, no side effects.

Weights are loaded with the worker's ``reload_weights(weights_iterator=...)``, which
streams checkpoint-format tensors through the model's ``load_weights`` layer by layer and
re-runs the post-load processing (on CPU, the repacking of linear layers). Calling the
model's ``load_weights`` directly would skip that processing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from raylign.rollout.buckets import BufferPool
from raylign.rollout.weight_sync import (
    IncomingSync,
    join_group_as_receiver,
    load_and_drain,
    with_tied_lm_head,
)


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker; attribute names are prefixed to avoid clashing with the worker's."""

    def raylign_join_sync_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        # Rank 0 is the trainer; tensor-parallel rank r of this engine is rank 1 + r.
        tp_rank = getattr(self, "rank", 0)
        self._raylign_sync = join_group_as_receiver(host, port, 1 + tp_rank, world_size, timeout_s)
        self._raylign_buffers = BufferPool()  # the buckets' buffers, kept from sync to sync

    def raylign_leave_sync_group(self) -> None:
        self._raylign_sync = self._raylign_buffers = None

    def raylign_receive_weights(self, version: int | None = None) -> dict[str, Any]:
        """Receive and load one sync; what arrived, as plain values (they cross vLLM's message encoding):
        its checksum and bucket count and how long loading waited for buckets, or ``corrupted``: the
        error of a damaged bucket."""
        sync = getattr(self, "_raylign_sync", None)
        if sync is None:
            raise RuntimeError("receive_weights before join_weight_sync_group")
        _, group = sync
        incoming = IncomingSync(group, version, f"vLLM worker {getattr(self, 'rank', 0)}", self._raylign_buffers)
        try:
            load_and_drain(incoming, self.raylign_load_weights)
        except Exception:
            if incoming.corruption is None:
                raise
            # Returned, not raised: vLLM's engine process passes on an error's message only, not its kind.
            return {"corrupted": incoming.corruption}
        return {"checksum": incoming.checksum, "num_buckets": incoming.num_buckets, "waited_s": incoming.waited_s}

    def raylign_receive_adapter(self, version: int, adapter: dict[str, Any], directory: str) -> dict[str, Any]:
        """Receive one sync of LoRA adapter weights; the first worker writes them, with ``adapter``
        (the adapter's config), as a PEFT adapter folder at ``directory`` for vLLM to load. Answers as
        :meth:`raylign_receive_weights`."""
        sync = getattr(self, "_raylign_sync", None)
        if sync is None:
            raise RuntimeError("receive_adapter before join_weight_sync_group")
        _, group = sync
        incoming = IncomingSync(group, version, f"vLLM worker {getattr(self, 'rank', 0)}", self._raylign_buffers)
        tensors: dict[str, torch.Tensor] = {}
        try:
            # Copies: the buckets' buffers are used again by the next sync.
            load_and_drain(incoming, lambda named: tensors.update((name, t.clone()) for name, t in named))
        except Exception:
            if incoming.corruption is None:
                raise
            return {"corrupted": incoming.corruption}
        if getattr(self, "rank", 0) == 0:  # vLLM reads the folder once and hands the adapter to every worker
            from raylign.engine.export import write_adapter_folder

            write_adapter_folder(directory, tensors, adapter)
        return {"checksum": incoming.checksum, "num_buckets": incoming.num_buckets, "waited_s": incoming.waited_s}

    def raylign_load_packed(self, packed: list) -> None:
        """Load tensors handed over as ``(name, dtype, shape, raw bytes)`` (see :func:`pack_tensors`)."""
        self.raylign_load_weights(unpack_tensors(packed))

    def raylign_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = bool(getattr(self._raylign_hf_config(), "tie_word_embeddings", False))
        self.reload_weights(weights_iterator=with_tied_lm_head(named_tensors, tied))  # type: ignore[attr-defined]

    def _raylign_hf_config(self) -> Any:
        hf_config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def pack_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int], bytes]]:
    """Tensors as plain values that survive vLLM's message encoding to its engine process."""
    return [
        (
            name,
            str(t.dtype).removeprefix("torch."),
            list(t.shape),
            t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(),
        )
        for name, t in named_tensors
    ]


def unpack_tensors(packed: list) -> Iterable[tuple[str, torch.Tensor]]:
    for name, dtype, shape, raw in packed:
        yield name, torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)
