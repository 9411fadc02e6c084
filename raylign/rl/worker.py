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
import os
import time
from pathlib import Path
from typing import Any

import torch

from raylign.algorithms import (
    POLICY_LOSSES,
    compute_entropy_bonus,
    compute_kl_loss,
    compute_loss_scale,
    compute_value_loss,
    mask_by_importance_ratio,
    truncated_importance_weights,
)
from raylign.config.rl import RLConfig
from raylign.rl.experience import gather_responses

Batch = dict[str, torch.Tensor]


class ModelWorker:
    def __init__(self, role: str, cfg: dict[str, Any], rank: int, world_size: int, master_addr: str,
                 master_port: int, total_steps: int):
        os.environ.update({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "RANK": str(rank),
                           "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        torch.set_flush_denormal(True)
        self.cfg = RLConfig.model_validate(cfg)
        # As many compute threads as the CPU slots Ray reserved for this worker (OpenMP stays at
        # OMP_NUM_THREADS for anything it starts).
        torch.set_num_threads(max(1, int(self.cfg.placement.cpus_per_worker)))
        self.role, self.rank, self.world_size = role, rank, world_size
        self.temperature = self.cfg.sampling.temperature or 1.0
        torch.manual_seed(self.cfg.train.seed)
        from raylign.models import load_causal_lm, load_score_model

        self._pool = None
        self._local_engine: Any = None
        self._weights_group: Any = None
        if role == "reference":
            model_cfg = self.cfg.reference or self.cfg.model.model_copy(
                update={"lora": self.cfg.model.lora.model_copy(update={"rank": 0})})
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            self.module = load_causal_lm(model_cfg, device=self.device).eval().requires_grad_(False)
            self.engine = None
            return
        from raylign.engine import create_engine
        from raylign.engine.distributed import init_distributed

        init_distributed(self.cfg.engine.dist_timeout_s)
        if role == "critic":
            critic_cfg = self.cfg.model.model_copy(update={"path": self.cfg.critic.path or self.cfg.model.path})
            model, optim = load_score_model(critic_cfg, num_labels=1), self.cfg.critic.optim
        else:
            model, optim = load_causal_lm(self.cfg.model), self.cfg.optim
        self.engine = create_engine(model, self.cfg.engine, optim, total_steps)
        self.module = self.engine.module
        self.device = self.engine.device

    # ---- forward passes ----------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, micro_batches: list[Batch]) -> list[torch.Tensor]:
        """Response log-probs ``[b, R]`` per micro-batch, at the sampling temperature."""
        self.module.eval()
        return [self._response_logprobs(batch).cpu() for batch in self._to_device(micro_batches)]

    def _response_logprobs(self, batch: Batch, with_entropy: bool = False):
        """Log-probs ``[b, R]`` of the response tokens (0 where masked), from logits at response positions only."""
        from raylign.models import selected_token_logprobs

        out = selected_token_logprobs(self.module, batch["input_ids"], batch["resp_index"],
                                      position_ids=batch["position_ids"], temperature=self.temperature,
                                      with_entropy=with_entropy)
        mask = batch["mask"]
        if with_entropy:
            return out[0] * mask, out[1] * mask
        return out * mask

    @torch.no_grad()
    def compute_values(self, micro_batches: list[Batch]) -> list[torch.Tensor]:
        """Critic values ``[b, R]``: V of the state before each response token."""
        self.module.eval()
        return [self._values(batch).cpu() for batch in self._to_device(micro_batches)]

    def _to_device(self, micro_batches: list[Batch]) -> list[Batch]:
        return [{k: v.to(self.device) for k, v in batch.items()} for batch in micro_batches]

    def _values(self, batch: Batch) -> torch.Tensor:
        from raylign.models import token_scores

        scores = token_scores(self.module, batch["input_ids"], position_ids=batch["position_ids"])
        return gather_responses(scores, batch["resp_index"], batch["mask"], shift=-1)

    # ---- updates -----------------------------------------------------------------------

    def _scale(self, masks: list[torch.Tensor]):
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_initialized() and self.world_size > 1 else None
        return compute_loss_scale(masks, process_group=group, max_response_length=self._max_len())

    def _max_len(self) -> int:
        a = self.cfg.algorithm
        return int(a.constant_normalizer or self.cfg.sampling.max_new_tokens)

    def train_policy(self, micro_batches: list[Batch]) -> dict[str, float]:
        """One optimizer step of the policy over this rank's micro-batches."""
        a = self.cfg.algorithm
        micro_batches = self._to_device(micro_batches)
        masks, weights, sums, maxes = [], [], {}, {}
        for batch in micro_batches:
            mask, token_weights = batch["mask"], None
            if a.off_policy == "truncated_is":
                token_weights, stats = truncated_importance_weights(
                    batch["old_logprobs"], batch["rollout_logprobs"], mask, cap=a.tis_cap)
                _accumulate(sums, stats, maxes)
            elif a.off_policy == "ratio_mask":
                mask, stats = mask_by_importance_ratio(batch["old_logprobs"], batch["rollout_logprobs"], mask,
                                                       low=a.mask_low, high=a.mask_high)
                _accumulate(sums, stats, maxes)
            masks.append(mask)
            weights.append(token_weights)
        scale = self._scale(masks)
        self.module.train()
        for batch, mask, token_weights in zip(micro_batches, masks, weights):
            loss, stats = self._policy_loss(batch, mask, token_weights, scale)
            self.engine.backward(loss)
            _accumulate(sums, {"policy_loss_total": loss.detach(), **stats}, maxes)
        step = self.engine.step()
        return {**_average(sums, maxes, len(micro_batches)), **step}

    def _policy_loss(self, batch: Batch, mask: torch.Tensor, token_weights, scale) -> tuple[torch.Tensor, dict]:
        a = self.cfg.algorithm
        logprobs, entropy = self._response_logprobs(batch, with_entropy=True)
        old_logprobs = batch.get("old_logprobs")
        stats: dict = {}
        if old_logprobs is None:  # on-policy: the behaviour policy is this policy before the step
            old_logprobs = logprobs.detach()
            diff = (batch["rollout_logprobs"] - old_logprobs) * mask
            stats["mismatch_abs_diff"] = diff.abs().sum() / mask.sum().clamp(min=1)
            stats["mismatch_max_abs_diff"] = diff.abs().max()
        clip = {"clip_eps_low": a.clip_eps_low, "clip_eps_high": a.clip_eps_high}
        if a.policy_loss == "ppo":
            clip["dual_clip_c"] = a.dual_clip_c
        loss, loss_stats = POLICY_LOSSES.get(a.policy_loss)(
            logprobs, old_logprobs, batch["advantages"], mask, token_weights=token_weights,
            aggregation=a.aggregation, scale=scale, **clip)
        stats.update({"policy_loss": loss.detach(), **loss_stats})
        if a.kl_mode == "loss" and a.kl_coef > 0:
            kl_loss, kl_stats = compute_kl_loss(logprobs, batch["ref_logprobs"], mask, estimator=a.kl_estimator,
                                                aggregation=a.aggregation, scale=scale)
            loss = loss + a.kl_coef * kl_loss
            stats.update(kl_stats)
        ent_loss, ent_stats = compute_entropy_bonus(entropy, mask, a.entropy_coef, aggregation=a.aggregation,
                                                    scale=scale)
        if a.entropy_coef > 0:
            loss = loss + ent_loss
        stats.update(ent_stats)
        return loss, stats

    def train_critic(self, micro_batches: list[Batch]) -> dict[str, float]:
        a = self.cfg.algorithm
        micro_batches = self._to_device(micro_batches)
        scale = self._scale([b["mask"] for b in micro_batches])
        self.module.train()
        sums: dict[str, float] = {}
        for batch in micro_batches:
            values = self._values(batch)
            loss, stats = compute_value_loss(values, batch["values"], batch["returns"], batch["mask"],
                                             clip_eps=a.value_clip, aggregation="token_mean", scale=scale)
            self.engine.backward(a.vf_coef * loss)
            _accumulate(sums, {"value_loss": loss.detach(), **stats})
        step = self.engine.step()
        return {**{k: v / len(micro_batches) for k, v in sums.items()}, **step}

    # ---- weights, checkpoints ------------------------------------------------------------

    def connect_engines(self, engines: list[Any]) -> None:
        """Rank 0 opens the weight-sync groups to the rollout engines."""
        if self.rank != 0:
            return
        from raylign.rollout.pool import RolloutPool

        self._pool = RolloutPool(engines)
        r = self.cfg.rollout
        self._pool.connect_weight_sync(bucket_mb=r.bucket_mb, timeout_s=r.sync_timeout_s)

    def sync_weights(self) -> dict[str, float]:
        """Collective over the policy ranks: gather full weights, then rank 0 pushes them in buckets
        to the engine actors, or (colocated) every rank loads them into its own engine."""
        start = time.perf_counter()
        state = self.engine.full_state_dict()
        gathered = time.perf_counter()
        if self._local_engine is not None:
            self._load_local_engine(state)
            return {"sync/gather_s": gathered - start, "sync/total_s": time.perf_counter() - start} if self.rank == 0 else {}
        if self.rank != 0:
            return {}
        stats = self._pool.sync_weights(state.items())
        return {"sync/gather_s": gathered - start, "sync/total_s": time.perf_counter() - start,
                **{f"sync/{k}": float(v) for k, v in vars(stats).items() if isinstance(v, (int, float))}}

    # ---- colocated rollout engine (the hybrid engine) ------------------------------------

    def start_local_engine(self, model_path: str) -> None:
        """Load this rank's rollout engine into this process (``placement.colocate``)."""
        from raylign.rollout.pool import engine_class

        self._local_engine = engine_class(self.cfg.rollout.engine)(model_path, self.cfg.rollout)
        if self.world_size > 1:
            import torch.distributed as dist

            # CPU tensors travel over gloo whatever backend the training group uses.
            self._weights_group = dist.new_group(backend="gloo")

    def _load_local_engine(self, state: dict[str, torch.Tensor]) -> None:
        from raylign.rollout.weight_sync import load_and_drain, receive_named_tensors, send_named_tensors

        def load(named_tensors) -> None:
            asyncio.run(self._local_engine.update_weights(named_tensors))

        if self._weights_group is None:
            load(state.items())
        elif self.rank == 0:
            send_named_tensors([self._weights_group], state.items(), int(self.cfg.rollout.bucket_mb * (1 << 20)))
            load(state.items())
        else:
            load_and_drain(receive_named_tensors(self._weights_group), load)

    def generate(self, prompt_token_ids: list[list[int]], sampling: Any, prompt_indices: list[int] | None = None):
        """Completions from this rank's colocated engine (the rollout pool's ``generate`` call)."""
        return asyncio.run(self._local_engine.generate(prompt_token_ids, sampling, prompt_indices))

    def sleep(self, level: int = 1) -> None:
        if self._local_engine is not None:
            asyncio.run(self._local_engine.sleep(level))

    def wake_up(self) -> None:
        if self._local_engine is not None:
            asyncio.run(self._local_engine.wake_up())

    def reset_prefix_cache(self) -> None:
        if self._local_engine is not None:
            asyncio.run(self._local_engine.reset_prefix_cache())

    def save_checkpoint(self, directory: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(Path(directory), client_state)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        return self.engine.load_checkpoint(Path(directory))

    def export_hf(self, directory: str) -> None:
        from raylign.models import load_tokenizer

        tokenizer = load_tokenizer(self.cfg.model.tokenizer_path or self.cfg.model.path)
        self.engine.export_hf(Path(directory), tokenizer)

    def placement_info(self) -> dict[str, Any]:
        """Where Ray put this worker: node id and the GPU ids it was given (empty on CPU)."""
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def offload(self) -> None:
        if self.engine is not None:
            self.engine.offload()

    def onload(self) -> None:
        if self.engine is not None:
            self.engine.onload()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close_weight_sync()


def _accumulate(sums: dict[str, float], stats: dict[str, Any], maxes: dict[str, float] | None = None) -> None:
    """Sum each statistic over micro-batches; statistics named ``*_max*`` keep their maximum instead."""
    for key, value in stats.items():
        value = float(value.item() if hasattr(value, "item") else value)
        if maxes is not None and "_max" in key:
            maxes[key] = max(maxes.get(key, value), value)
        else:
            sums[key] = sums.get(key, 0.0) + value


def _average(sums: dict[str, float], maxes: dict[str, float], count: int) -> dict[str, float]:
    return {**{k: v / count for k, v in sums.items()}, **maxes}
