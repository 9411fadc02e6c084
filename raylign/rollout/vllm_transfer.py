"""A gloo backend for vLLM's weight-transfer API, so that weights reach vLLM the same way on CPU and GPU.

vLLM (0.32) moves a trainer's weights into its workers through a pluggable weight-transfer engine:
each worker builds one at model load from ``weight_transfer_config``, and the engine's
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and
``finish_weight_update`` reach it in every worker. vLLM builds in NCCL and CUDA IPC, which need
GPUs. This module registers one more backend, :data:`BACKEND`, that carries the same calls over the
checksummed gloo bucket stream of :mod:`raylign.rollout.sync_wire`; :class:`~raylign.rollout.vllm_engine.VLLMEngine`
drives every full-weight update through these calls.

One update:

* ``init_weight_transfer_engine(GlooInitInfo)``, once: join the trainer's group as rank
  ``rank_offset`` + this worker's rank.
* ``start_weight_update``: vLLM's layerwise reload begins; each layer's tensors are set aside, and
  the layer is rebuilt and processed (on CPU, its linear layers repacked) once all its weights arrived.
* ``update_weights({"version": v})``: take in the buckets, check each one's checksum, load its
  tensors. ``update_weights({"version": v, "packed": [...]})`` loads tensors handed over inline
  instead, one bucket a call (an engine in the trainer's own process has no group).
* ``finish_weight_update``: the reload ends; layers that received nothing keep their tensors. vLLM
  warns "<layer>: Failed to load weights" for each such layer; for a rotary embedding, whose cos/sin
  cache is computed and in no checkpoint, that is expected at every update, so :func:`register`
  drops that one warning (any other layer's still shows).

vLLM's ``update_weights`` answers nothing, so the outcome is kept as :attr:`GlooWeightTransferEngine.receipt`
(the checksum and bucket count of what arrived, or the error) and read back by the worker
extension's ``raylign_sync_receipt``. A failed receive (a damaged bucket, a sender that aborted or
died) is recorded there rather than raised: raising would end vLLM's update without finishing the
layerwise reload and leave layers without weights, while finishing it keeps the engine usable until
the next full sync.

The backend is registered wherever the worker extension (:mod:`raylign.rollout.vllm_worker`) is
imported, which vLLM does in every worker process before it loads the model.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from raylign.rollout.buckets import BufferPool, group_into_buckets
from raylign.rollout.sync_wire import IncomingSync, load_and_drain
from raylign.rollout.vllm_engine import TRANSFER_BACKEND as BACKEND
from raylign.rollout.weight_sync import join_group_as_receiver, retire_group, with_tied_lm_head


def register() -> None:
    """Make :data:`BACKEND` a weight-transfer backend in this process (again: no effect)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, GlooWeightTransferEngine.__name__)
    logging.getLogger(RELOAD_LOGGER).addFilter(ROTARY_RELOAD_FILTER)  # a filter already there is not added twice


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" warning where the layer is a rotary embedding
    (``RotaryEmbedding``, ``Llama3RotaryEmbedding``, ...): it has no weights to send, and vLLM keeps its
    computed cos/sin cache. The engine's log-probs after each sync are checked by the probe instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        rotary = bool(args) and str(args[0]).endswith("RotaryEmbedding")
        return not (record.msg == "%s: Failed to load weights" and rotary)


ROTARY_RELOAD_FILTER = RotaryReloadFilter()


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is (its ``TCPStore``), its size, and which rank the first worker takes."""

    host: str
    port: int
    world_size: int
    timeout_s: float
    rank_offset: int = 1


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: its weight version (names it in errors), and tensors handed over inline, if any
    (one of :func:`pack_buckets`), instead of buckets from the group."""

    version: int | None = None
    packed: list | None = None


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None
        self.rank = 0  # in the trainer's group; the trainer is rank 0
        self.buffers = BufferPool()  # the buckets' buffers, kept from sync to sync
        self.receipt: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.rank = init_info.rank_offset + worker
        retire_group(self.group)
        _, self.group = join_group_as_receiver(
            init_info.host, init_info.port, self.rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.receipt = {}
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # the base class synchronizes unconditionally, which fails on CPU
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if update_info.packed is not None:  # one bucket of several, each its own call
            self.load(unpack_tensors(update_info.packed))
            self.receipt = {"inline": self.receipt.get("inline", 0) + len(update_info.packed)}
            return
        self.receipt = self.receive(update_info.version, self.load)

    def receive(self, version: int | None, load: Any) -> dict[str, Any]:
        """Take in one sync from the group, handing its tensors to ``load``; what arrived, as plain
        values (they cross vLLM's message encoding): its checksum, bucket count and how long loading
        waited for buckets, or ``corrupted`` (a damaged bucket) or ``error`` (anything else) with the message."""
        if self.group is None:
            raise RuntimeError("weight update before init_weight_transfer_engine: this worker is in no sync group")
        incoming = IncomingSync(self.group, version, f"vLLM worker {self.rank - 1}", self.buffers)
        try:
            load_and_drain(incoming, load)
        except Exception as err:
            if incoming.corruption is not None:
                return {"corrupted": incoming.corruption}
            return {"error": f"{type(err).__name__}: {err}"}
        return {"checksum": incoming.checksum, "num_buckets": incoming.num_buckets, "waited_s": incoming.waited_s}

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        hf_config = self.model_config.hf_config
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        tied = bool(getattr(text_config, "tie_word_embeddings", False))
        self.model.load_weights(with_tied_lm_head(named_tensors, tied))

    def shutdown(self) -> None:
        retire_group(self.group)
        self.group = None


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, str, list[int], bytes]]]:
    """Tensors as plain values that survive vLLM's message encoding to its engine process, grouped
    as the sync's buckets are (:func:`~raylign.rollout.buckets.group_into_buckets`: about
    ``bucket_bytes`` each, a larger tensor alone), each group handed out before the next is read."""
    for group in group_into_buckets(named_tensors, bucket_bytes):
        yield [
            (
                name,
                str(t.dtype).removeprefix("torch."),
                list(t.shape),
                t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),  # 0-dim too
            )
            for name, t in group
        ]


def unpack_tensors(packed: list) -> Iterable[tuple[str, torch.Tensor]]:
    for name, dtype, shape, raw in packed:
        if not raw:  # torch.frombuffer refuses an empty buffer
            yield name, torch.empty(shape, dtype=getattr(torch, dtype))
            continue
        yield name, torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)
