"""One Ray actor per data-parallel rank of a model: the policy, the critic or the frozen reference.

Trainable roles wrap a training engine (``local``, ``fsdp2`` or ``deepspeed``) and join a
torch.distributed group with their peers; the reference holds a frozen replica. The
controller sends each rank its micro-batches (see :mod:`raylign.rl.experience`); the
losses come from the algorithm library, composed as explicit terms.

With colocated placement (the hybrid engine) each policy rank also hosts a rollout engine in
its own process: the controller's rollout pool calls the worker's ``generate``, and a weight
sync hands the gathered full weights to that engine in memory. With several ranks, rank 0
broadcasts them to the others in size-bounded buckets over a gloo group of the policy ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from raylign.algorithms import (
    POLICY_LOSSES,
    LossScale,
    compute_entropy_bonus,
    compute_kl_loss,
    compute_loss_scale,
    compute_value_loss,
    importance_ratio_sums,
    mask_by_importance_ratio,
    truncated_importance_weights,
)
from raylign.config.rl import AlgorithmConfig, RLConfig
from raylign.hardware import flush_denormals
from raylign.rl.experience import MicroBatch, gather_responses
from raylign.rl.metric import Metric, combine, effective_sample_size

# ``correct(batch) -> (loss mask, token weights or None, statistics)`` for the trainer-vs-engine gap.
OffPolicyCorrection = Callable[[MicroBatch], tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]]
# Statistics of the algorithm library that are maxima; all others are means over counted tokens.
MAXIMA = {"ratio_max"}

log = logging.getLogger("raylign")


class ModelWorker:
    """Made in two calls, so that rank 0 can host the process group's rendezvous on whatever node
    Ray put it: the constructor only reads the config; :meth:`rendezvous_address` (rank 0) opens
    the store and says where it listens; :meth:`start` (every rank, given that address) joins the
    group and loads the model."""

    def __init__(self, role: str, cfg: dict[str, Any], rank: int, world_size: int, total_steps: int):
        os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
        flush_denormals()
        self.cfg = RLConfig.model_validate(cfg)
        # Until the controller sets them for the phases (set_threads, in_phase): as many compute threads
        # as pinned, or as the CPU slots Ray reserved for this worker.
        p = self.cfg.placement
        torch.set_num_threads(
            max(1, int(p.cpus_per_worker)) if p.threads_per_worker == "auto" else p.threads_per_worker
        )
        self.role, self.rank, self.world_size, self.total_steps = role, rank, world_size, total_steps
        self.temperature = self.cfg.sampling.temperature or 1.0
        # The algorithm's choices, bound once: the update itself does not look at their names.
        a = self.cfg.algorithm
        self.policy_loss = bind_policy_loss(a)
        self.correct_off_policy = bind_off_policy_correction(a)
        self._pool = None
        self._local_engine: Any = None
        self._store: Any = None
        self.rendezvous: tuple[str, int] | None = None
        self.engine: Any = None
        self.reference: torch.nn.Module | None = None  # a reference model hosted by a policy rank
        # Sequence parallelism: the ranks of this rank's group run one chunk each of the same rows.
        self.sequence_group: Any = None
        # Its ring's sends and receives wait at most engine.dist_timeout_s, as its collectives do.
        self.sequence_timeout = datetime.timedelta(seconds=self.cfg.engine.dist_timeout_s)
        # How many ranks take each data shard (a tensor- or sequence-parallel group) and give one answer.
        self.copies = 1

    def rendezvous_address(self) -> tuple[str, int] | None:
        """Rank 0 of a trained role: host the process group's store on this node; returns
        ``(this node's address, the store's port)`` for the other ranks to dial. None for the
        reference when its workers hold whole replicas, which form no group."""
        if self.role == "reference" and not self.cfg.shards_reference:
            return None
        import ray

        from raylign.engine.distributed import host_rendezvous_store

        host = ray.util.get_node_ip_address()
        self._store = host_rendezvous_store(host, self.world_size, self.cfg.engine.dist_timeout_s)
        return host, int(self._store.port)

    def start(self, rendezvous: tuple[str, int] | None) -> None:
        """Join the process group at ``rendezvous`` (rank 0's address and port) and load the model."""
        self.rendezvous = rendezvous
        os.environ.update(
            {"RANK": str(self.rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": "1"}
        )
        if rendezvous is not None:  # read by DeepSpeed, which otherwise looks for MPI
            os.environ.update({"MASTER_ADDR": rendezvous[0], "MASTER_PORT": str(rendezvous[1])})
        torch.manual_seed(self.cfg.train.seed)
        from raylign.engine import create_engine
        from raylign.engine.distributed import init_distributed
        from raylign.models import load_causal_lm, load_score_model, loads_sharded

        if self.role == "reference":
            if self.cfg.shards_reference:
                init_distributed(self.cfg.engine.dist_timeout_s, store=self._rendezvous_store(rendezvous))
            self.module, self.device = self._load_reference(sharded=self.cfg.shards_reference)
            return
        init_distributed(self.cfg.engine.dist_timeout_s, store=self._rendezvous_store(rendezvous))
        from raylign.engine.distributed import sequence_parallel_groups
        from raylign.models.sequence_parallel import SEQUENCE_ATTENTION

        e, model_cfg = self.cfg.engine, self.cfg.model
        if self.role == "critic":
            model_cfg = model_cfg.model_copy(update={"path": self.cfg.critic.path or self.cfg.model.path})
        if e.sequence_parallel_size > 1:
            model_cfg = model_cfg.model_copy(
                update={"attn_implementation": SEQUENCE_ATTENTION[e.sequence_parallel_mode]}
            )
            self.sequence_group, _, _ = sequence_parallel_groups(
                e.sequence_parallel_size, e.dist_timeout_s, e.tensor_parallel_size
            )
        self.copies = e.tensor_parallel_size * e.sequence_parallel_size
        if self.role == "critic":
            model = load_score_model(model_cfg, num_labels=1, empty=loads_sharded(model_cfg, e))
            optim = self.cfg.critic.optim
        else:
            model, optim = load_causal_lm(model_cfg, empty=loads_sharded(model_cfg, e)), self.cfg.optim
        self.engine = create_engine(model, self.cfg.engine, optim, self.total_steps)
        self.module = self.engine.module
        self.device = self.engine.device
        if self.role == "policy" and self.cfg.hosts_reference:
            self.reference, _ = self._load_reference(sharded=self.cfg.shards_reference)

    def _load_reference(self, sharded: bool) -> tuple[torch.nn.Module, torch.device]:
        """The frozen reference model (``reference``, else the policy's model without adapters) and its
        device: a whole replica, or (``sharded``) a shard of it on each rank of this process's group,
        in its stored dtype and gathered a layer at a time as it runs."""
        from raylign.models import load_causal_lm, loads_sharded

        model_cfg = self.cfg.reference or self.cfg.model.model_copy(
            update={"lora": self.cfg.model.lora.model_copy(update={"rank": 0})}
        )
        if not sharded:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            return load_causal_lm(model_cfg, device=device).eval().requires_grad_(False), device
        from raylign.engine.fsdp2 import shard_frozen

        return shard_frozen(load_causal_lm(model_cfg, empty=loads_sharded(model_cfg, self.cfg.engine)), self.cfg.engine)

    def _rendezvous_store(self, rendezvous: tuple[str, int] | None) -> Any:
        """Rank 0's own store, or a connection to it."""
        if self._store is not None:
            return self._store
        if rendezvous is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: start() needs rank 0's rendezvous address")
        import ray

        from raylign.engine.distributed import join_rendezvous_store

        who = f"{self.role} rank {self.rank} on node {ray.util.get_node_ip_address()}"
        host, port = rendezvous
        return join_rendezvous_store(host, port, self.world_size, self.cfg.engine.dist_timeout_s, who)

    # ---- compute threads -----------------------------------------------------------------

    def set_threads(self, threads: int) -> None:
        """Compute on ``threads`` torch threads from now on (the colocated engine too: it runs in this process)."""
        torch.set_num_threads(threads)

    def in_phase(self, threads: int, method: str, *args: Any) -> tuple[Any, int, int | None, float]:
        """``method(*args)`` computed on ``threads`` torch threads (the controller's share of the cores
        free during this phase); its result, the threads torch reports at its end, the peak memory
        while it ran (:class:`~raylign.engine.memory.PhasePeak`: the device's on a GPU, the process's
        resident memory on the CPU) and the seconds it took in this process."""
        from raylign.engine.memory import PhasePeak

        torch.set_num_threads(threads)
        with PhasePeak(self.device) as peak:
            start = time.perf_counter()
            result = getattr(self, method)(*args)
            seconds = time.perf_counter() - start
        return result, torch.get_num_threads(), peak.bytes, seconds

    # ---- forward passes ----------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Response log-probs ``[b, R]`` per micro-batch, at the sampling temperature."""
        self.module.eval()
        return [
            response_logprobs(
                self.module, batch.to(self.device), self.temperature, self.sequence_group, self.sequence_timeout
            ).cpu()
            for batch in micro_batches
        ]

    @torch.no_grad()
    def compute_reference_logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """A policy rank's reference log-probs (``RLConfig.reference_in_policy``): those of the reference
        model it hosts (``RLConfig.hosts_reference``), or of a LoRA policy's base model, its adapters
        turned off."""
        if self.reference is not None:
            return [
                response_logprobs(self.reference, batch.to(self.device), self.temperature).cpu()
                for batch in micro_batches
            ]
        with self.engine.hf_model.disable_adapter():
            return self.compute_logprobs(micro_batches)

    @torch.no_grad()
    def compute_values(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Critic values ``[b, R]``: V of the state before each response token."""
        self.module.eval()
        return [self._values(batch.to(self.device)).cpu() for batch in micro_batches]

    def _values(self, batch: MicroBatch) -> torch.Tensor:
        from raylign.models import token_scores

        if self.sequence_group is not None:
            from raylign.models.sequence_parallel import sharded_response_values

            return sharded_response_values(
                self.module,
                batch.input_ids,
                batch.resp_index,
                batch.position_ids,
                self.sequence_group,
                batch.mask,
                timeout=self.sequence_timeout,
            )
        scores = token_scores(self.module, batch.input_ids, position_ids=batch.position_ids)
        return gather_responses(scores, batch.resp_index, batch.mask, shift=-1)

    # ---- updates -----------------------------------------------------------------------

    def _scale(self, masks: list[torch.Tensor]) -> LossScale:
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_initialized() and self.world_size > 1 else None
        return compute_loss_scale(masks, process_group=group, max_response_length=self._max_len())

    def _max_len(self) -> int:
        a = self.cfg.algorithm
        return int(a.constant_normalizer or self.cfg.sampling.max_new_tokens)

    def train_policy(self, micro_batches: list[MicroBatch]) -> dict[str, Metric]:
        """One optimizer step of the policy over this rank's micro-batches; its statistics."""
        micro_batches = [batch.to(self.device) for batch in micro_batches]
        corrected, stats = [], []
        for batch in micro_batches:
            mask, token_weights, correction_stats = self.correct_off_policy(batch)
            corrected.append((mask, token_weights))
            stats.append(_correction_metrics(correction_stats, batch))
        scale = self._scale([mask for mask, _ in corrected])
        self.module.train()
        losses = []
        for batch, (mask, token_weights) in zip(micro_batches, corrected):
            loss, loss_stats = self._policy_loss(batch, mask, token_weights, scale)
            losses.append(loss.detach())
            self.engine.backward(loss)
            stats.append(loss_stats)
        return {**combine(stats), **_step_metrics(self.engine.step(finite_loss=self._finite("policy", losses)))}

    def _finite(self, role: str, losses: list[torch.Tensor]) -> bool:
        """Whether every micro-batch's loss is finite (one device sync for all); names those that
        are not (the update is then skipped)."""
        finite = torch.isfinite(torch.stack(losses))
        if bool(finite.all()):
            return True
        for j in (~finite).nonzero().flatten().tolist():
            log.warning(
                "%s rank %d: the loss of micro-batch %d is %s; this update is skipped",
                role,
                self.rank,
                j,
                float(losses[j]),
            )
        return False

    def _policy_loss(
        self, batch: MicroBatch, mask: torch.Tensor, token_weights: torch.Tensor | None, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        """One micro-batch's loss (the sum of :func:`policy_loss_terms`) and its metrics."""
        terms, stats, logprobs = policy_loss_terms(
            self.module,
            batch,
            mask,
            token_weights,
            scale,
            self.cfg.algorithm,
            self.policy_loss,
            self.temperature,
            self.sequence_group,
            self.sequence_timeout,
        )
        loss = sum(terms.values())
        metrics = {
            **_token_means(stats, mask),
            "policy_loss": _loss_share(terms["policy_loss"], scale, self.copies),
            "policy_loss_total": _loss_share(loss, scale, self.copies),
        }
        if batch.behaviour == "this_policy":  # no recomputation to compare the engine with: measure it here
            metrics.update(_engine_mismatch(batch.rollout_logprobs, logprobs, mask))
        return loss, metrics

    def train_critic(self, micro_batches: list[MicroBatch]) -> dict[str, Metric]:
        a = self.cfg.algorithm
        micro_batches = [batch.to(self.device) for batch in micro_batches]
        scale = self._scale([batch.mask for batch in micro_batches])
        self.module.train()
        stats, losses = [], []
        for batch in micro_batches:
            loss, loss_stats = compute_value_loss(
                self._values(batch),
                batch.values,
                batch.returns,
                batch.mask,
                clip_eps=a.value_clip,
                aggregation="token_mean",
                scale=scale,
            )
            losses.append(loss.detach())
            self.engine.backward(a.vf_coef * loss)
            stats.append({**_token_means(loss_stats, batch.mask), "value_loss": _loss_share(loss, scale, self.copies)})
        return {**combine(stats), **_step_metrics(self.engine.step(finite_loss=self._finite("critic", losses)))}

    # ---- weights, checkpoints ------------------------------------------------------------

    def connect_engines(self, engines: list[Any]) -> None:
        """Rank 0 opens the weight-sync groups to the rollout engines."""
        if self.rank != 0:
            return
        from raylign.rollout.pool import RolloutPool

        self._pool = RolloutPool(engines)
        r = self.cfg.rollout
        self._pool.connect_weight_sync(bucket_mb=r.bucket_mb, timeout_s=r.sync_timeout_s)

    def replace_engines(self, replaced: dict[int, Any]) -> None:
        """Rank 0 opens sync groups to engines that took the place of dead ones (``index -> actor``)."""
        if self.rank == 0:
            self._pool.reconnect_weight_sync(replaced)

    def sync_weights(self, version: int | None = None, only: list[int] | None = None) -> dict[str, float]:
        """Collective over the policy ranks: gather full weights while rank 0 pushes them in buckets
        to the engine actors (all, or the engines ``only``), or (colocated) every rank loads them into
        its own engine as they are gathered; the engines label them ``version`` (the controller's count
        of updates). A LoRA policy with ``rollout.lora_sync: adapter`` gathers and sends its adapter
        weights only."""
        if self._local_engine is not None:
            return self._sync_local_engine(version)
        if not self.cfg.syncs_adapters:
            return self._stream_weights(version, only)
        start = time.perf_counter()
        state, adapter = self.engine.adapter_state_dict()
        gathered = time.perf_counter()
        if self.rank != 0:
            return {}
        stats = self._pool.sync_weights(
            state.items(), keep_running=self.cfg.rollout.partial_rollouts, version=version, only=only, adapter=adapter
        )
        return _sync_metrics(gathered - start, time.perf_counter() - start, stats)

    def _stream_weights(self, version: int | None, only: list[int] | None) -> dict[str, float]:
        """Full weights to the engine actors as they are gathered (:meth:`TrainEngine.iter_full_state`):
        rank 0 packs each tensor into the buckets while the next one is gathered. ``sync/gather_s`` is
        the time spent gathering, inside ``sync/total_s``."""
        from raylign.rollout.weight_sync import TimedIterator

        start = time.perf_counter()
        stream = self.engine.iter_full_state()
        if self.rank != 0:
            for _ in stream:  # the gathers are collectives: keep in step with rank 0
                pass
            return {}
        gather = TimedIterator(stream)
        try:
            stats = self._pool.sync_weights(
                gather, keep_running=self.cfg.rollout.partial_rollouts, version=version, only=only
            )
        finally:
            for _ in stream:  # a sync that failed part-way: the other ranks still gather the rest
                pass
        return _sync_metrics(gather.seconds, time.perf_counter() - start, stats)

    # ---- colocated rollout engine (the hybrid engine) ------------------------------------

    def start_local_engine(self, model_path: str) -> None:
        """Load this rank's rollout engine into this process (``placement.colocate``)."""
        from raylign.rollout.pool import engine_class

        # The engine's coroutines all run on one event loop of their own (vLLM's asynchronous engine
        # keeps tasks on the loop it started on), in a thread beside this actor's calls.
        self._engine_loop = asyncio.new_event_loop()
        threading.Thread(target=self._engine_loop.run_forever, name="rollout-engine-loop", daemon=True).start()
        lora_rank = self.cfg.model.lora.rank if self.cfg.syncs_adapters else 0
        rollout = self.cfg.rollout
        if rollout.enable_sleep_mode is None:  # a colocated engine sleeps by phase unless told otherwise
            rollout = rollout.model_copy(update={"enable_sleep_mode": True})
        self._local_engine = engine_class(rollout.engine)(model_path, rollout, lora_rank)

    def _sync_local_engine(self, version: int | None) -> dict[str, float]:
        """Colocated: every rank gathers the weights (the all-gathers hand each rank the whole tensor)
        and loads them into its own engine as they arrive, a tensor (FSDP2) or a layer (DeepSpeed) at a
        time; a LoRA policy's adapter (``rollout.lora_sync: adapter``) is gathered whole, it is small.
        Nothing crosses between ranks but the gathers, and no rank holds the whole model twice. The
        handover to the engine carries no checksum (hf: a memory copy; vLLM: its own channel to its
        engine process): the probe covers it. ``sync/gather_s`` (rank 0) is the gathering's share."""
        from raylign.rollout.weight_sync import TimedIterator

        start = time.perf_counter()
        label = "the weight sync" if version is None else f"weight sync {version}"
        if self.cfg.syncs_adapters:
            state, adapter = self.engine.adapter_state_dict(every_rank=True)
            gather_s = time.perf_counter() - start
            self._on_engine_loop(
                self._local_engine.load_adapter(state.items(), adapter, version), f"loading {label}'s adapter"
            )
        else:
            # The engine's loop consumes the stream, so the gathers run on its thread, this one waiting.
            stream = TimedIterator(self.engine.iter_full_state(every_rank=True))
            try:
                self._on_engine_loop(self._local_engine.update_weights(stream, False, version), f"loading {label}")
            except BaseException:
                # A load that failed part-way: the other ranks still gather the rest (a stream still
                # running on the engine's thread refuses a second reader; the run ends either way).
                with contextlib.suppress(ValueError):
                    for _ in stream:
                        pass
                raise
            gather_s = stream.seconds
        if self.rank != 0:
            return {}
        return {"sync/gather_s": gather_s, "sync/total_s": time.perf_counter() - start}

    def _on_engine_loop(self, coroutine: Any, what: str | None = None) -> Any:
        """Run one of the local engine's coroutines on its loop; waits at most rollout.generate_timeout_s.
        ``what`` names the call in the timeout's error (default: the engine method's name)."""
        what = what or getattr(coroutine, "__qualname__", "a call").rsplit("<locals>.", 1)[-1]
        future = asyncio.run_coroutine_threadsafe(coroutine, self._engine_loop)
        try:
            return future.result(timeout=self.cfg.rollout.generate_timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"policy rank {self.rank}: its colocated rollout engine did not finish {what} within "
                f"rollout.generate_timeout_s ({self.cfg.rollout.generate_timeout_s:g} s)"
            ) from None

    def generate(self, prompt_token_ids: list[list[int]], sampling: Any, prompt_indices: list[int] | None = None):
        """Completions from this rank's colocated engine (the rollout pool's ``generate`` call)."""
        return self._on_engine_loop(self._local_engine.generate(prompt_token_ids, sampling, prompt_indices))

    def generate_group(self, prompt_token_ids: list[int], sampling: Any, prompt_index: int = 0):
        """One prompt group from this rank's colocated engine (the rollout stream's call)."""
        return self._on_engine_loop(self._local_engine.generate_group(prompt_token_ids, sampling, prompt_index))

    def local_engine_adapters(self) -> list[int]:
        """The LoRA adapters (weight versions) this rank's colocated vLLM engine holds."""
        return self._on_engine_loop(self._local_engine.adapters_loaded())

    def score(self, token_ids: list[int], base: bool = False) -> Any:
        """This rank's colocated engine's scores of a probe sequence (the rollout pool's ``score`` call)."""
        return self._on_engine_loop(self._local_engine.score(token_ids, base))

    @torch.no_grad()
    def score_probe(self, token_ids: list[int], base: bool = False) -> tuple[str, list[float]]:
        """The policy's ``log p(token_t | tokens before t)`` for ``t >= 1`` of one fixed sequence, at
        temperature 1 (what the engines report for it), through the same forward as training; and the
        dtype it computes in. ``base``: a LoRA policy's base model, its adapters off. A collective on
        sharded backends: every rank calls it."""
        if base:
            with self.engine.hf_model.disable_adapter():
                return self.score_probe(token_ids)
        from raylign.hardware import resolve_dtype
        from raylign.models import selected_token_logprobs

        self.module.eval()
        input_ids = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(1, len(token_ids), device=self.device)[None]
        logprobs = selected_token_logprobs(self.module, input_ids, positions, temperature=1.0)
        # The dtype the model was loaded in and computes in (FSDP2 may keep fp32 master weights beside it).
        return resolve_dtype(self.cfg.model.dtype, self.device)[0], logprobs[0].float().cpu().tolist()

    def sleep(self, level: int = 1) -> None:
        if self._local_engine is not None:
            self._on_engine_loop(self._local_engine.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self._local_engine is not None:
            self._on_engine_loop(self._local_engine.wake_up(tags))

    def reset_prefix_cache(self) -> None:
        if self._local_engine is not None:
            self._on_engine_loop(self._local_engine.reset_prefix_cache())

    def stop_local_engine(self) -> None:
        """Let the colocated engine stop what it started outside this process (vLLM's engine-core and
        worker processes, their shared memory, the adapters' folders) before the actor is killed,
        which would leave that shared memory behind."""
        if self._local_engine is not None:
            engine, self._local_engine = self._local_engine, None
            self._on_engine_loop(engine.shutdown(), "shutdown")

    def save_checkpoint(self, directory: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(Path(directory), client_state)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        return self.engine.load_checkpoint(Path(directory))

    def export_hf(self, directory: str) -> None:
        self.engine.export_hf(Path(directory), self._tokenizer())

    def write_engine_base(self, directory: str) -> None:
        """The base the rollout engines start from when it is not the model folder's: a 4-bit base
        (QLoRA), dequantised, so the engines compute what this policy computes
        (:meth:`TrainEngine.write_base_folder`)."""
        self.engine.write_base_folder(Path(directory), self._tokenizer())

    def _tokenizer(self) -> Any:
        """The run's tokenizer, for the folders this worker writes."""
        from raylign.models import load_tokenizer

        return load_tokenizer(self.cfg.model.tokenizer_path or self.cfg.model.path)

    def placement_info(self) -> dict[str, Any]:
        """Where Ray put this worker: node id, the cores this process may run on, the node's address, the
        GPU ids it was given (empty on CPU), the rendezvous it used (``host:port``, hosted by rank 0;
        None for a reference of whole replicas) and the bytes of model weights this rank holds (its
        shards, when sharded), and of the reference model it hosts (0 for none)."""
        import ray
        from torch.distributed.tensor import DTensor

        def held(module: torch.nn.Module | None) -> int:
            local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()] if module else []
            return sum(p.numel() * p.element_size() for p in local)

        return {
            "node": ray.get_runtime_context().get_node_id(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
            "ip": ray.util.get_node_ip_address(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "rendezvous": None if self.rendezvous is None else f"{self.rendezvous[0]}:{self.rendezvous[1]}",
            "weight_bytes": held(self.module),
            "reference_weight_bytes": held(self.reference),
        }

    def offload(self, keep_weights: bool = False) -> None:
        if self.engine is not None:
            self.engine.offload(keep_weights)

    def onload(self) -> None:
        if self.engine is not None:
            self.engine.onload()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close_weight_sync()


def response_logprobs(
    module: torch.nn.Module,
    batch: MicroBatch,
    temperature: float,
    sequence_group: Any = None,
    sequence_timeout: datetime.timedelta | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> Any:
    """Log-probs ``[b, R]`` of the response tokens (0 where masked), and with ``with_entropy`` their
    entropies: the output layer runs at the masked-in response positions only (see
    :func:`raylign.models.selected_token_logprobs`, which also says what ``entropy_grad`` does).
    With a ``sequence_group`` its ranks run one chunk each of the rows and all get the whole result
    (:func:`raylign.models.sequence_parallel.sharded_selected_token_logprobs`), each exchange between them
    waiting at most ``sequence_timeout`` (default: the ring's own, 30 minutes)."""
    from raylign.models import selected_token_logprobs

    if sequence_group is not None:
        from raylign.models.ring_attention import DEFAULT_TIMEOUT
        from raylign.models.sequence_parallel import sharded_selected_token_logprobs

        return sharded_selected_token_logprobs(
            module,
            batch.input_ids,
            batch.resp_index,
            batch.position_ids,
            sequence_group,
            temperature=temperature,
            with_entropy=with_entropy,
            mask=batch.mask,
            entropy_grad=entropy_grad,
            timeout=sequence_timeout or DEFAULT_TIMEOUT,
        )
    return selected_token_logprobs(
        module,
        batch.input_ids,
        batch.resp_index,
        position_ids=batch.position_ids,
        temperature=temperature,
        with_entropy=with_entropy,
        mask=batch.mask,
        entropy_grad=entropy_grad,
    )


def policy_loss_terms(
    module: torch.nn.Module,
    batch: MicroBatch,
    mask: torch.Tensor,
    token_weights: torch.Tensor | None,
    scale: LossScale,
    a: AlgorithmConfig,
    policy_loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    temperature: float,
    sequence_group: Any = None,
    sequence_timeout: datetime.timedelta | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """One micro-batch's policy loss as named terms (policy gradient, KL to the reference, entropy
    bonus), the algorithm library's statistics, and the training forward's log-probs ``[b, R]``.

    The entropy is always measured (``stats["entropy"]``), but differentiated only when the bonus
    counts (``entropy_coef > 0``): otherwise it comes from detached logits, and the forward keeps no
    float32 tokens x vocabulary tensors for it until the backward pass.
    """
    logprobs, entropy = response_logprobs(
        module, batch, temperature, sequence_group, sequence_timeout, with_entropy=True, entropy_grad=a.entropy_coef > 0
    )
    pg_loss, stats = policy_loss(
        logprobs,
        batch.behaviour_logprobs(logprobs),
        batch.advantages,
        mask,
        token_weights=token_weights,
        scale=scale,
    )
    terms = {"policy_loss": pg_loss}
    if a.kl_mode == "loss" and a.kl_coef > 0:
        kl_loss, kl_stats = compute_kl_loss(
            logprobs, batch.ref_logprobs, mask, estimator=a.kl_estimator, aggregation=a.aggregation, scale=scale
        )
        terms["kl_loss"] = a.kl_coef * kl_loss
        stats = {**stats, **kl_stats}
    entropy_loss, entropy_stats = compute_entropy_bonus(
        entropy, mask, a.entropy_coef, aggregation=a.aggregation, scale=scale
    )
    if a.entropy_coef > 0:
        terms["entropy_loss"] = entropy_loss
    return terms, {**stats, **entropy_stats}, logprobs


def bind_policy_loss(a: AlgorithmConfig) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The configured policy loss with its clip range and aggregation bound:
    ``loss(logprobs, old_logprobs, advantages, mask, token_weights=..., scale=...)``."""
    clip = {"clip_eps_low": a.clip_eps_low, "clip_eps_high": a.clip_eps_high}
    if a.policy_loss == "ppo":  # dual-clip belongs to the token-level surrogate
        clip["dual_clip_c"] = a.dual_clip_c
    return functools.partial(POLICY_LOSSES.get(a.policy_loss), aggregation=a.aggregation, **clip)


def bind_off_policy_correction(a: AlgorithmConfig) -> OffPolicyCorrection:
    """The configured correction of the trainer-vs-engine gap, ``rho = pi_old / pi_rollout`` (see
    :mod:`raylign.algorithms.off_policy`): truncated weights, a narrower loss mask, or nothing."""

    def truncated_is(batch: MicroBatch):
        weights, stats = truncated_importance_weights(
            batch.old_logprobs, batch.rollout_logprobs, batch.mask, cap=a.tis_cap
        )
        return batch.mask, weights, stats

    def ratio_mask(batch: MicroBatch):
        mask, stats = mask_by_importance_ratio(
            batch.old_logprobs, batch.rollout_logprobs, batch.mask, low=a.mask_low, high=a.mask_high
        )
        return mask, None, stats

    def none(batch: MicroBatch):
        return batch.mask, None, {}

    return {"truncated_is": truncated_is, "ratio_mask": ratio_mask, "none": none}[a.off_policy]


def _token_means(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, Metric]:
    """The algorithm library's statistics of one micro-batch: means over ``mask``'s counted tokens
    (weighted by their number when combined), but for the maxima in ``MAXIMA``."""
    tokens = float(mask.sum())
    return {
        name: Metric(float(value), "max") if name in MAXIMA else Metric(float(value), "mean", tokens)
        for name, value in stats.items()
    }


def _correction_metrics(stats: dict[str, torch.Tensor], batch: MicroBatch) -> dict[str, Metric]:
    """The off-policy correction's statistics of one micro-batch as token means, but for the effective
    sample size fraction: carried as its sums, so that the step logs that of all its tokens, over
    micro-batches, ranks and updates (a mean of the micro-batches' fractions overstates it)."""
    metrics = _token_means(stats, batch.mask)
    if "is_ess_fraction" in stats:
        sums = importance_ratio_sums(batch.old_logprobs, batch.rollout_logprobs, batch.mask)
        metrics["is_ess_fraction"] = effective_sample_size(*sums.tolist())
    return metrics


def _engine_mismatch(rollout_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, Metric]:
    """How far the engine's log-probs are from the training forward's: mean and largest ``|difference|``."""
    diff = ((rollout_logprobs - logprobs.detach()) * mask).abs()
    tokens = float(mask.sum())
    return {
        "mismatch_abs_diff": Metric(float(diff.sum()) / max(tokens, 1.0), "mean", tokens),
        "mismatch_max_abs_diff": Metric(float(diff.max()), "max"),
    }


def _sync_metrics(gather_s: float, total_s: float, stats: Any) -> dict[str, float]:
    """A sync's logged figures: its gather and total seconds, and the pool's own (``SyncStats``) numbers."""
    numbers = {f"sync/{k}": float(v) for k, v in vars(stats).items() if isinstance(v, (int, float))}
    return {"sync/gather_s": gather_s, "sync/total_s": total_s, **numbers}


def _loss_share(loss: torch.Tensor, scale: LossScale, copies: int = 1) -> Metric:
    """This micro-batch's share of the whole batch's loss.

    ``compute_loss_scale`` makes each micro-batch loss ``(its part of the global numerator) /
    global denominator * world_size``, so that gradients summed over micro-batches and averaged
    over ranks are those of the one-big-batch loss. Its value divided by ``world_size`` is then
    its share: summed over the micro-batches of all ranks, the shares give the batch loss,
    whatever the micro-batch split.

    When ``copies`` ranks (a tensor- or sequence-parallel group) take the same data, the global
    denominator counted their tokens ``copies`` times, and only one of them answers: its share is
    ``copies`` times larger.
    """
    return Metric(float(loss.detach()) / scale.world_size * copies, "sum")


def _step_metrics(step: dict[str, float]) -> dict[str, Metric]:
    """Optimizer-step statistics (gradient norm, learning rate): one value per rank and update."""
    return {name: Metric(float(value)) for name, value in step.items()}
