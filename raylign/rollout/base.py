"""The one interface every generation engine offers, and what it returns.

Prompts go in as token ids and completions come out as token ids: text is decoded for
reward functions and logs, never tokenised again. Log-probs are those of the
distribution each token was actually drawn from (the behaviour policy):

    logprob_t = log_softmax(filter_{k,p}(logits_t / T))[token_t]

where ``filter_{k,p}`` keeps the ``top_k`` most likely tokens, then the smallest set whose
mass reaches ``top_p`` (sets the rest to -inf, then renormalises). With ``top_k`` and
``top_p`` off this is ``log_softmax(logits / T)``, what a trainer recomputes for the
importance ratio. Greedy decoding (``T == 0``) reports ``log_softmax(logits)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import TYPE_CHECKING, Any, Literal

import torch

from raylign.config.rollout import SamplingConfig

if TYPE_CHECKING:
    from raylign.rollout.weight_sync import SyncReceipt

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length"]


@dataclass
class Completion:
    """One sampled continuation of one prompt.

    ``response_logprobs[t]`` is the engine's log-prob of ``response_token_ids[t]`` (see the
    module docstring for the distribution). ``finish_reason`` is "stop" when the model
    emitted an end-of-sequence token or a stop string, "length" when ``max_new_tokens``
    ran out. ``text`` is the decoded response without special tokens, ending right after
    the stop string that ended it, if any. ``weight_version`` counts the weight updates the
    engine had applied when this completion's first token was sampled (a request that waited out
    an update in the engine's queue started under the new weights); ``token_versions[t]`` is the version of
    the weights that sampled ``response_token_ids[t]`` (later than ``weight_version`` for the
    tokens of a partial rollout sampled after an update that came mid-sequence).
    """

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    finish_reason: FinishReason
    text: str
    weight_version: int = 0
    token_versions: list[int] | None = None
    finished_at: float = 0.0  # wall-clock time (time.time()) when the engine finished the completion

    def __post_init__(self) -> None:
        self.finished_at = self.finished_at or time.time()
        if self.token_versions is None:
            self.token_versions = [self.weight_version] * len(self.response_token_ids)
        elif len(self.token_versions) != len(self.response_token_ids):
            raise ValueError(
                f"prompt {self.prompt_index}, sample {self.sample_index}: {len(self.token_versions)} "
                f"token versions for {len(self.response_token_ids)} tokens"
            )


@dataclass
class TokenScores:
    """An engine's scores of a fixed token sequence (the weight-sync probe): ``logprobs[t - 1]`` is
    ``log p(token_t | tokens before t)`` for ``t >= 1``, the raw distribution (temperature 1, no
    filtering), under weight ``version``, computed in ``dtype`` (e.g. "float32")."""

    version: int
    dtype: str
    logprobs: list[float]


def check_probe(token_ids: Sequence[int], vocab_size: int) -> None:
    """A probe needs at least two tokens, all in the vocabulary."""
    if len(token_ids) < 2:
        raise ValueError(f"a probe sequence needs at least 2 tokens to score, got {len(token_ids)}")
    check_prompts([token_ids], vocab_size, [0])


class RolloutEngine(ABC):
    """A generation engine: one model replica (possibly tensor-parallel over several devices).

    All methods are coroutines so that an engine runs unchanged inside a Ray async actor
    or in the trainer's own process (colocated). Many :meth:`generate_group` calls may be in
    flight on one engine at once (continuous batching); a weight update waits for the
    sequences in flight to finish, or, with ``keep_running``, lets them continue under the
    new weights (partial rollouts) where the engine can.
    """

    weight_version: int = 0
    vocab_size: int
    max_model_len: int | None = None  # longest prompt + response served (rollout.max_model_len); None: no bound

    async def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingConfig,
        prompt_indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Sample ``sampling.n`` completions per prompt, returned prompt by prompt, sample by sample.

        ``prompt_indices`` (default ``0..len-1``) label the prompts in the returned
        completions and derive per-prompt seeds; a pool passes each prompt's index in the
        whole request. Every prompt is its own group, all in flight at once.
        """
        sampling = sampling if isinstance(sampling, SamplingConfig) else SamplingConfig.model_validate(sampling)
        indices = default_prompt_indices(prompt_token_ids, prompt_indices)
        check_prompts(prompt_token_ids, self.vocab_size, indices, self.max_model_len)
        groups = await asyncio.gather(
            *(self._group(list(ids), sampling, index) for index, ids in zip(indices, prompt_token_ids))
        )
        return [c for group in groups for c in group]

    async def generate_group(
        self, prompt_token_ids: list[int], sampling: SamplingConfig, prompt_index: int = 0
    ) -> list[Completion]:
        """The ``sampling.n`` completions of one prompt, returned once all of them have finished.

        The streaming form of :meth:`generate`: a caller keeps many groups in flight and takes
        each as it finishes.
        """
        sampling = sampling if isinstance(sampling, SamplingConfig) else SamplingConfig.model_validate(sampling)
        check_prompts([prompt_token_ids], self.vocab_size, [prompt_index], self.max_model_len)
        return await self._group(list(prompt_token_ids), sampling, prompt_index)

    @abstractmethod
    async def _group(self, prompt: list[int], sampling: SamplingConfig, index: int) -> list[Completion]:
        """The completions of one prompt whose token ids were checked (``index`` labels them)."""

    @abstractmethod
    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], keep_running: bool = False, version: int | None = None
    ) -> float:
        """Load full weights (Hugging Face names) handed over in this process; returns seconds taken.

        Resets the prefix cache and sets ``weight_version`` to ``version`` (default: one more);
        ``keep_running`` as in :meth:`receive_weights`.
        """

    @abstractmethod
    async def join_weight_sync_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        """Join the private gloo group a :class:`~raylign.rollout.weight_sync.WeightSyncSender` opened.

        The sender is rank 0; this engine's workers take ranks ``1..world_size-1``.
        """

    @abstractmethod
    async def receive_weights(self, keep_running: bool = False, version: int | None = None) -> SyncReceipt:
        """Receive one full weight sync from the group and load it; returns the version it now holds
        and the checksum of what it received (:class:`~raylign.rollout.weight_sync.SyncReceipt`).

        Resets the prefix cache and sets ``weight_version`` to ``version`` (default: one more; the
        trainer passes its own count, so versions survive a restart of the engines). Sequences in flight finish under
        the old weights first, unless ``keep_running``: then they are paused where they are and
        continue under the new weights (partial rollouts; engines that cannot pause
        mid-sequence finish them first).
        """

    async def receive_adapter(self, adapter: dict[str, Any], version: int | None = None) -> SyncReceipt:
        """Receive one sync of LoRA adapter weights (PEFT's saved names; ``adapter`` is its
        ``adapter_config.json``) and serve them, from the next request on, as the adapter of weight
        version ``version`` (default: one more). Requests in flight keep the adapter they started
        with, and their tokens its version; nothing pauses, no cache is reset."""
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters; use rollout.lora_sync: merged")

    async def load_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: dict[str, Any], version: int | None = None
    ) -> float:
        """:meth:`receive_adapter` for adapter weights handed over in this process; returns seconds taken."""
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters; use rollout.lora_sync: merged")

    @abstractmethod
    async def score(self, token_ids: list[int], base: bool = False) -> TokenScores:
        """Log-probs of each token of ``token_ids`` after the first, given those before it, under the
        weights held now (the probe that checks a weight sync; one prefill, nothing sampled).
        ``base``: under the base weights alone, without the LoRA adapter served (engines that serve
        adapters; the others refuse)."""

    @abstractmethod
    async def leave_weight_sync_group(self) -> None:
        """Drop the sync group (no-op when not joined)."""

    @abstractmethod
    async def num_sync_ranks(self) -> int:
        """How many ranks this engine takes in a weight-sync group (its tensor-parallel size)."""

    @abstractmethod
    async def reset_prefix_cache(self) -> None:
        """Forget cached KV blocks (they were computed with older weights)."""

    async def sleep(self, level: int = 1) -> None:
        """Free weights / KV cache while the devices train; a logged no-op where unsupported."""
        log_once(f"{type(self).__name__}: sleep() is not supported here; the engine stays loaded")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep`, for all the engine's memory or for ``tags`` only (vLLM's ``"weights"``,
        ``"kv_cache"``: a colocated run wakes the weights for the sync, the cache once the trainer has
        moved out); a no-op where unsupported."""
        log_once(f"{type(self).__name__}: wake_up() is not supported here; nothing to do")

    async def weight_version_now(self) -> int:
        return self.weight_version

    async def node_id(self) -> str:
        """The id of the Ray node this engine's actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def shutdown(self) -> None:  # noqa: B027 - an optional hook
        """Release what the engine started outside its own process (a no-op unless it did)."""


_logged_once: set[str] = set()


def log_once(message: str) -> None:
    """Log ``message`` at warning level the first time this process sees it."""
    if message not in _logged_once:
        _logged_once.add(message)
        logger.warning(message)


def default_prompt_indices(
    prompt_token_ids: Sequence[Sequence[int]], prompt_indices: Sequence[int] | None
) -> list[int]:
    if prompt_indices is None:
        return list(range(len(prompt_token_ids)))
    if len(prompt_indices) != len(prompt_token_ids):
        raise ValueError(
            f"got {len(prompt_indices)} prompt indices for {len(prompt_token_ids)} prompts; give one per prompt"
        )
    return [int(i) for i in prompt_indices]


def check_prompts(
    prompt_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    prompt_indices: Sequence[int],
    max_model_len: int | None = None,
) -> None:
    """Reject negative prompt indices, empty prompts, token ids outside the vocabulary and prompts that
    leave no room for a response within ``max_model_len``, naming the prompt."""
    if not isinstance(prompt_token_ids, Sequence) or isinstance(prompt_token_ids, (str, bytes)):
        raise TypeError("prompt_token_ids must be a list of token-id lists (text is never tokenised here)")
    for index, ids in zip(prompt_indices, prompt_token_ids):
        if isinstance(index, bool) or not isinstance(index, Integral) or index < 0:
            raise ValueError(
                f"prompt index {index!r}: must be an integer >= 0 (it labels the prompt's completions and seeds its "
                "samples)"
            )
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError(f"prompt {index}: expected a list of token ids, got {type(ids).__name__}")
        if len(ids) == 0:
            raise ValueError(f"prompt {index}: empty prompt (needs at least one token id)")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        if max_model_len is not None and len(ids) >= max_model_len:
            raise ValueError(
                f"prompt {index}: {len(ids)} tokens leave no room for a response within rollout.max_model_len "
                f"({max_model_len} tokens of prompt and response)"
            )


def request_seed(sampling: SamplingConfig, prompt_index: int) -> int | None:
    """Seed of prompt ``prompt_index``'s first sample; sample j uses this + j (None when unseeded)."""
    if sampling.seed is None:
        return None
    return sampling.seed + prompt_index * sampling.n


def cut_after_stop_string(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """Text up to and including the earliest-ending stop string; and whether one was found."""
    ends = [text.find(s) + len(s) for s in stop if s in text]
    if not ends:
        return text, False
    return text[: min(ends)], True
