"""Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``), and the registration of
raylign's weight-transfer backend in the worker's process.

Full weights reach the workers through vLLM's weight-transfer API, carried by the backend of
:mod:`raylign.rollout.vllm_transfer`. vLLM imports this module in every worker process before it
loads the model (where the transfer engine is built), which is why the backend is registered here.
The methods below cover what that API does not:

* ``raylign_sync_receipt``: the outcome of the last update, which vLLM's ``update_weights`` does not return;
* ``raylign_receive_adapter``: a LoRA policy's adapter weights (``rollout.lora_sync: adapter``),
  received over the same group and written by the first worker as a PEFT adapter folder, which the
  engine then adds as a vLLM LoRA adapter (they are not loaded into the model).

vLLM mixes the class into its worker class, in whatever process the worker runs (the engine core's
process when tensor_parallel_size is 1, spawned processes otherwise), and the engine calls these
methods through ``collective_rpc``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from raylign.rollout import vllm_transfer

vllm_transfer.register()


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker; attribute names are prefixed to avoid clashing with the worker's."""

    def raylign_sync_receipt(self) -> dict[str, Any]:
        """What the last weight update received (see :attr:`GlooWeightTransferEngine.receipt`)."""
        return self._raylign_transfer().receipt

    def raylign_transfer_backend(self) -> str:
        """The class of this worker's weight-transfer engine."""
        return type(self._raylign_transfer()).__name__

    def raylign_compute(self) -> dict[str, int]:
        """The process this worker computes in and its torch threads."""
        return {"pid": os.getpid(), "threads": torch.get_num_threads()}

    def raylign_receive_adapter(self, version: int, adapter: dict[str, Any], directory: str) -> dict[str, Any]:
        """Receive one sync of LoRA adapter weights; the first worker writes them, with ``adapter``
        (the adapter's config), as a PEFT adapter folder at ``directory`` for vLLM to load. Answers as
        :meth:`GlooWeightTransferEngine.receive`."""
        tensors: dict[str, torch.Tensor] = {}
        # Copies: the buckets' buffers are used again by the next sync.
        received = self._raylign_transfer().receive(
            version, lambda named: tensors.update((name, t.clone()) for name, t in named)
        )
        if "checksum" in received and getattr(self, "rank", 0) == 0:  # vLLM reads the folder for every worker
            from raylign.engine.export import write_adapter_folder

            write_adapter_folder(directory, tensors, adapter)
        return received

    def _raylign_transfer(self) -> vllm_transfer.GlooWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, vllm_transfer.GlooWeightTransferEngine):
            raise RuntimeError(
                f"this vLLM worker's weight-transfer engine is {type(engine).__name__}, not raylign's gloo backend "
                f"(weight_transfer_config backend {vllm_transfer.BACKEND!r})"
            )
        return engine
