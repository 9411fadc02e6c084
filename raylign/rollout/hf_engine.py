"""Generation with transformers ``generate``, for machines without vLLM.

Same contract as the vLLM engine (:mod:`raylign.rollout.base`): token ids in, token ids
and log-probs out. The log-prob of a sampled token is taken from the distribution it was
sampled from (temperature, then top-k, then top-p, then log-softmax), the same distribution
vLLM reports with ``logprobs_mode="processed_logprobs"``; greedy decoding reports
``log_softmax(logits)``.

The model's own ``generation_config`` (repetition penalty, default top-k 50, ...) is
replaced by a neutral one at load time, so only :class:`SamplingConfig` shapes sampling.
Unseeded prompts of a batch share one left-padded ``generate`` call, a seeded prompt has one
of its own (:meth:`HFEngine._generate_now`); :class:`RowSampler` picks every token, each sample
from a random stream of its own (:meth:`HFEngine._sample_seeds`). So a sample does not depend on
which other requests share its batch or when they arrived, a run repeats its samples, and
torch's global random state is never used (a colocated trainer shares the process).

Streaming (:meth:`HFEngine.generate_group`): prompt groups queue up while a batch runs (in a
thread, so the actor keeps taking requests); the next batch takes every queued group with
the same sampling settings. A weight update waits for the running batch, so each sample
comes from one weight version (this engine cannot pause mid-sequence).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.engine.host_stash import HostStash
from raylign.hardware import flush_denormals, resolve_and_log
from raylign.rollout.base import (
    Completion,
    RolloutEngine,
    TokenScores,
    check_probe,
    cut_after_stop_string,
    request_seed,
)
from raylign.rollout.buckets import BufferPool
from raylign.rollout.weight_sync import (
    IncomingSync,
    SyncReceipt,
    join_group_as_receiver,
    load_and_drain,
    retire_group,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StopStringCriteria:
    """Stops a row once its decoded response contains a stop string; remembers at which step."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], prompt_len: int):
        self.tokenizer, self.stop, self.prompt_len = tokenizer, list(stop), prompt_len
        self.stopped_at: dict[int, int] = {}  # row -> number of response tokens when the stop string completed

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        num_generated = input_ids.shape[1] - self.prompt_len
        for row in range(input_ids.shape[0]):
            if row in self.stopped_at:
                done[row] = True
                continue
            text = self.tokenizer.decode(input_ids[row, self.prompt_len :], skip_special_tokens=True)
            if any(s in text for s in self.stop):
                self.stopped_at[row] = num_generated
                done[row] = True
        return done


def neutral_generation_config(model_generation_config: Any) -> Any:
    """A GenerationConfig with only the end-of-sequence and pad ids of the model's."""
    from transformers import GenerationConfig

    return GenerationConfig(
        eos_token_id=model_generation_config.eos_token_id,
        pad_token_id=model_generation_config.pad_token_id,
        bos_token_id=model_generation_config.bos_token_id,
    )


def _eos_ids(model: Any) -> set[int]:
    ids = model.generation_config.eos_token_id
    if ids is None:
        ids = model.config.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])}


class RowSampler:
    """Picks every row's next token for ``generate`` and keeps its log-probability.

    Given as the last logits processor of a ``do_sample=False`` call: it returns scores that leave
    only the token it picked, so generate's argmax takes that one. Greedy (no seeds): the most
    likely token, with its ``log_softmax(logits)``. Sampled: the logits pass temperature, top-k and
    top-p (transformers' own warpers, in the order ``generate`` applies them), and row ``r`` takes
    its step's uniform number from a generator seeded with ``seeds[r]``, inverted through the row's
    cumulative distribution (exact sampling). A row's draws depend on its seed alone, never
    on the other rows of the batch or on torch's global random state.
    """

    #: Steps of uniform numbers a row draws at a time: one call per row and chunk, not per row and step,
    #: and at most 4 KB a row held however long the responses may grow.
    CHUNK = 1024

    def __init__(self, seeds: list[int] | None, sampling: SamplingConfig):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.warpers = LogitsProcessorList()
        self.generators: list[torch.Generator] = []
        self.uniforms: torch.Tensor | None = None  # (rows, steps) of the current chunk
        if seeds is not None:
            self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                self.warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(sampling.top_p))
            self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
            self.remaining = sampling.max_new_tokens  # steps not yet drawn
            self._draw()
        self._steps: list[torch.Tensor] = []  # per step: each row's picked token's log-prob, (rows, 1)

    def _draw(self) -> None:
        """The next chunk of every row's uniform numbers, from the row's own generator."""
        steps = min(self.remaining, self.CHUNK)
        self.remaining -= steps
        self.uniforms = torch.stack([torch.rand(steps, generator=g) for g in self.generators])

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logprobs = torch.log_softmax(self.warpers(input_ids, scores.float()), dim=-1)
        if self.uniforms is None:
            tokens = logprobs.argmax(dim=-1, keepdim=True)
        else:
            if self.uniforms.shape[0] != scores.shape[0]:
                raise RuntimeError(f"{self.uniforms.shape[0]} sample seeds for {scores.shape[0]} rows")
            step = len(self._steps) % self.CHUNK
            if step == 0 and self._steps:
                self._draw()
            cdf = logprobs.exp().cumsum(dim=-1)
            total = cdf[:, -1:]
            uniform = self.uniforms[:, step, None].to(cdf.device)
            # Strictly below the total, so the first entry above the draw exists and has mass.
            draw = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
            tokens = torch.searchsorted(cdf, draw, right=True)
        self._steps.append(logprobs.gather(-1, tokens))
        return torch.full_like(scores, float("-inf")).scatter_(-1, tokens, 0.0)

    def logprobs(self, steps: int) -> torch.Tensor:
        """The picked tokens' log-probs of the first ``steps`` steps (generate may undo its last few): (rows, steps)."""
        return torch.cat(self._steps[:steps], dim=1)


def response_length(tokens: list[int], eos_ids: set[int], stop_step: int | None) -> tuple[int, bool]:
    """Tokens that belong to the response (through the first EOS or stop string), and whether it stopped."""
    end = len(tokens)
    stopped = False
    for t, token in enumerate(tokens):
        if token in eos_ids:
            end, stopped = t + 1, True
            break
    if stop_step is not None and stop_step <= end:
        end, stopped = stop_step, True
    return end, stopped


class HFEngine(RolloutEngine):
    """:class:`RolloutEngine` over a transformers causal LM. Wrap with ``ray.remote`` for an actor."""

    def __init__(self, model_path: str, config: RolloutConfig | dict[str, Any] | None = None, lora_rank: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config if isinstance(config, RolloutConfig) else RolloutConfig.model_validate(config or {})
        self.max_model_len = self.config.max_model_len
        if self.config.tensor_parallel_size != 1:
            raise ValueError("rollout.tensor_parallel_size must be 1 for the hf engine")
        if lora_rank:
            raise ValueError("the hf engine serves no LoRA adapters; use rollout.lora_sync: merged")
        flush_denormals()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._requests_of: Counter[int] = Counter()  # unseeded requests so far, by prompt index
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=_DTYPES[resolve_and_log(self.config.dtype, "hf rollout engine")]
        )
        self.model.to(self.device).eval()
        self.model.generation_config = neutral_generation_config(self.model.generation_config)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.eos_ids = _eos_ids(self.model)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.weight_version = 0
        self._sync_group: Any = None
        self._loop: Any = None  # the event loop the queue below belongs to
        # Queued groups: prompt, prompt index, its samples' seeds, sampling, the caller's future.
        self._queue: list[tuple[list[int], int, list[int], SamplingConfig, asyncio.Future]] = []
        self._batcher: asyncio.Task | None = None
        self._busy: asyncio.Lock | None = None  # held by a running batch and by a weight update
        self.asleep = False  # weights in host memory while a colocated trainer uses the device
        self.stash = HostStash()  # pinned host memory for sleep()

    def _lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new asyncio.run(): nothing of the old loop's is in flight
            self._loop, self._queue, self._batcher, self._busy = loop, [], None, asyncio.Lock()
        return self._busy

    async def _group(self, prompt: list[int], sampling: SamplingConfig, index: int) -> list[Completion]:
        self._lock()
        future = asyncio.get_running_loop().create_future()
        self._queue.append((prompt, index, self._sample_seeds(sampling, index), sampling, future))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._run_batches())
        return await future

    def _sample_seeds(self, sampling: SamplingConfig, index: int) -> list[int]:
        """Each sample's seed. Seeded requests: ``request_seed`` + sample, as vLLM. Unseeded: derived from
        ``rollout.seed``, the prompt index and how many unseeded requests for that index came before, so
        a repeated request draws afresh while the seeds do not depend on the order in which requests
        arrive; nor, where each index is requested once (a run's stream numbers its groups), on which
        engine of a pool (all share ``rollout.seed``) serves them."""
        if sampling.temperature == 0.0:
            return []  # greedy: nothing is drawn
        first = request_seed(sampling, index)
        if first is not None:
            return [first + sample for sample in range(sampling.n)]
        earlier = self._requests_of[index]
        self._requests_of[index] += 1
        entropy = [self.config.seed, index, earlier]
        return [int(seed) for seed in np.random.SeedSequence(entropy).generate_state(sampling.n, dtype=np.uint64)]

    async def _run_batches(self) -> None:
        """Run the queued groups, a batch at a time (each batch: the queued groups sampled alike)."""
        while self._queue:
            async with self._lock():
                sampling = self._queue[0][3]
                batch = [r for r in self._queue if r[3] == sampling]
                self._queue = [r for r in self._queue if r[3] != sampling]
                try:
                    completions = await asyncio.to_thread(
                        self._generate_now,
                        [r[0] for r in batch],
                        [r[1] for r in batch],
                        [r[2] for r in batch],
                        sampling,
                    )
                except BaseException as err:  # every caller of this batch gets the error
                    for *_, future in batch:
                        if not future.done():
                            future.set_exception(err)
                    continue
                n = sampling.n  # completions come prompt by prompt, n each
                for position, (*_, future) in enumerate(batch):
                    if not future.done():
                        future.set_result(completions[position * n : (position + 1) * n])

    def _generate_now(
        self, prompts: list[list[int]], indices: list[int], seeds: list[list[int]], sampling: SamplingConfig
    ) -> list[Completion]:
        """Completions prompt by prompt, ``n`` each: unseeded prompts in one call, seeded ones each alone.

        A seeded prompt's call holds its own rows only (no padding, no other prompt's rows), so its
        log-probs, not only its tokens, do not depend on what else was queued: a seeded run repeats
        exactly (``rollout.reproducible``). Batch shapes change the rounding of the logits by ~1e-7,
        which the behaviour log-probs carry into the loss and AdamW can enlarge."""
        self._check_awake("generate")
        if sampling.seed is None:
            return self._generate_batch(prompts, indices, seeds, sampling)
        completions = []
        for prompt, index, prompt_seeds in zip(prompts, indices, seeds):
            completions += self._generate_batch([prompt], [index], [prompt_seeds], sampling)
        return completions

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], indices: list[int], seeds: list[list[int]], sampling: SamplingConfig
    ) -> list[Completion]:
        """One left-padded ``generate`` call for ``prompts``; completions prompt by prompt, ``n`` each."""
        from transformers import LogitsProcessorList, StoppingCriteriaList

        width = max(len(p) for p in prompts)
        pad = self.model.generation_config.pad_token_id
        pad = next(iter(self.eos_ids)) if pad is None else pad
        greedy = sampling.temperature == 0.0
        per_prompt = 1 if greedy else sampling.n  # greedy samples are all the same; row i * n + j: sample j
        rows = [p for p in prompts for _ in range(per_prompt)]
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=self.device)
        stop_criteria = StopStringCriteria(self.tokenizer, sampling.stop, width)
        sampler = RowSampler(None if greedy else [seed for row in seeds for seed in row], sampling)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,  # the sampler's scores leave one token each row's argmax
            logits_processor=LogitsProcessorList([sampler]),
            max_new_tokens=sampling.max_new_tokens,
            stopping_criteria=StoppingCriteriaList([stop_criteria]) if sampling.stop else None,
            return_dict_in_generate=True,
        )
        responses = out.sequences[:, width:]
        logprobs = sampler.logprobs(responses.shape[1]).cpu()
        completions = []
        for i, (prompt, index) in enumerate(zip(prompts, indices)):
            for sample in range(sampling.n):
                row = i * per_prompt + (0 if greedy else sample)
                completions.append(
                    self._completion(
                        prompt,
                        index,
                        sample,
                        responses[row].tolist(),
                        logprobs[row].tolist(),
                        sampling,
                        stop_criteria.stopped_at.get(row),
                    )
                )
        return completions

    def _completion(
        self,
        prompt: list[int],
        index: int,
        sample: int,
        tokens: list[int],
        logprobs: list[float],
        sampling: SamplingConfig,
        stop_step: int | None,
    ) -> Completion:
        end, stopped = response_length(tokens, self.eos_ids, stop_step)
        if self.max_model_len is not None and len(prompt) + end > self.max_model_len:
            # The sequence reached max_model_len first: it ends there, as vLLM ends it.
            end, stopped, stop_step = self.max_model_len - len(prompt), False, None
        text = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
        if stop_step is not None:
            text, _ = cut_after_stop_string(text, sampling.stop)
        return Completion(
            prompt_index=index,
            sample_index=sample,
            prompt_token_ids=prompt,
            response_token_ids=tokens[:end],
            response_logprobs=logprobs[:end],
            finish_reason="stop" if stopped else "length",
            text=text,
            weight_version=self.weight_version,
        )

    @torch.no_grad()
    def _load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # state_dict lists tied weights under both names; both point at the same parameter.
        targets = self.model.state_dict(keep_vars=True)
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                raise KeyError(f"weight {name!r} is not a parameter of the rollout model")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
                )
            target.copy_(tensor)

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], keep_running: bool = False, version: int | None = None
    ) -> float:
        start = time.perf_counter()
        async with self._lock():  # after the running batch
            self._load_named_tensors(named_tensors)
            self.weight_version = self.weight_version + 1 if version is None else version
        return time.perf_counter() - start

    async def join_weight_sync_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        if world_size != 2:
            raise ValueError(f"sync group of size {world_size} for an hf engine (one worker: size 2)")
        retire_group(self._sync_group)
        self._sync_group = join_group_as_receiver(host, port, 1, world_size, timeout_s)
        self._sync_buffers = BufferPool()  # the buckets' buffers, kept from sync to sync

    async def receive_weights(self, keep_running: bool = False, version: int | None = None) -> SyncReceipt:
        """``keep_running`` makes no difference here: the running batch finishes under the old weights."""
        if self._sync_group is None:
            raise RuntimeError("receive_weights before join_weight_sync_group")
        start = time.perf_counter()
        async with self._lock():
            incoming = IncomingSync(self._sync_group[1], version, "the hf engine", self._sync_buffers)
            load_and_drain(incoming, self._load_named_tensors)
            self.weight_version = self.weight_version + 1 if version is None else version
        seconds = time.perf_counter() - start
        return SyncReceipt(self.weight_version, incoming.checksum, incoming.num_buckets, seconds, incoming.waited_s)

    async def score(self, token_ids: list[int], base: bool = False) -> TokenScores:
        if base:
            raise NotImplementedError("the hf engine serves no LoRA adapters: it has no base model apart from its own")
        check_probe(token_ids, self.vocab_size)
        async with self._lock():  # after the running batch, never during a weight update
            logprobs = await asyncio.to_thread(self._score_now, list(token_ids))
            return TokenScores(self.weight_version, str(self.model.dtype).removeprefix("torch."), logprobs)

    @torch.no_grad()
    def _score_now(self, token_ids: list[int]) -> list[float]:
        self._check_awake("score")
        input_ids = torch.tensor([token_ids], device=self.device)
        logits = self.model(input_ids=input_ids).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[0, 1:, None]).squeeze(-1).cpu().tolist()

    async def leave_weight_sync_group(self) -> None:
        retire_group(self._sync_group)
        self._sync_group = None

    async def num_sync_ranks(self) -> int:
        return 1

    async def reset_prefix_cache(self) -> None:
        """Nothing to do: each generate call starts with an empty KV cache."""

    # ---- colocation ------------------------------------------------------------------------

    def sleeps(self) -> bool:
        """Whether :meth:`sleep` frees device memory: on a GPU with ``rollout.enable_sleep_mode`` (on by
        default for a colocated engine)."""
        return self.device.type == "cuda" and bool(self.config.enable_sleep_mode)

    async def sleep(self, level: int = 1) -> None:
        """Move the weights to (pinned) host memory and return the freed blocks to the device, after the
        running batch. Both levels keep the host copy: vLLM's level 2 drops its weights and rebuilds them from the
        next sync, which this engine cannot do for weights a sync does not cover. There is no KV cache to
        free: each generate call builds its own and drops it at the end."""
        if not self.sleeps():
            return await super().sleep(level)
        async with self._lock():
            self.stash.move_module(self.model, torch.device("cpu"))  # pinned: the copy runs at the link's speed
            self.asleep = True
            torch.cuda.empty_cache()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring the weights back to the device (``tags`` None or holding ``"weights"``); ``"kv_cache"``
        alone has nothing to bring back (see :meth:`sleep`)."""
        if not self.sleeps():
            return await super().wake_up(tags)
        if tags is None or "weights" in tags:
            async with self._lock():
                self.stash.move_module(self.model, self.device)
                self.asleep = False

    def _check_awake(self, what: str) -> None:
        if self.asleep:
            raise RuntimeError(
                f"the hf engine was asked to {what} while asleep (its weights in host memory); "
                "wake_up(['weights']) first"
            )
