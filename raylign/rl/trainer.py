"""The RL controller: one process that drives rollout engines, reward sources and model workers.

One step, as data: prompt batch -> engines (n samples per prompt; token ids and log-probs)
-> rewards -> experience (behaviour log-probs recomputed by the policy, reference log-probs,
values) -> advantages -> policy / critic updates -> weight sync to the engines -> metrics,
checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raylign.cluster import start_ray
from raylign.config.base import save_yaml
from raylign.config.rl import RLConfig
from raylign.data import ResumableSampler
from raylign.engine.checkpoint import latest_checkpoint, prune_checkpoints, step_directory, write_atomically
from raylign.rl.advantages import compute_advantages, shaped_rewards
from raylign.rl.evaluation import pass_at_k_metrics
from raylign.rl.experience import (
    Sample,
    micro_batches_for_ranks,
    mismatch_metrics,
    pack_samples,
    response_mask,
    response_tensor,
    reward_metrics,
    split_by_reward_variance,
)
from raylign.rl.placement import check_gpu_count, placement_groups
from raylign.rl.prompts import Prompt, load_prompts
from raylign.trainers.metrics import MetricsLogger, format_metrics
from raylign.trainers.progress import Progress

log = logging.getLogger("raylign")


class RLTrainer:
    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self.out = Path(cfg.train.output_dir)
        self.step = 0
        self.groups: dict[str, Any] = {}
        self.syncs = 0  # weight syncs sent to the engines (their weight_version once received)
        # Asynchronous rollout: the next step's prompt positions, their request in flight, then its samples.
        self._next_indices: list[int] | None = None
        self._ahead: Any = None
        self._prefetched: list[Sample] | None = None

    # ---- set-up --------------------------------------------------------------------------

    def setup(self) -> None:
        import ray

        from raylign.models import load_tokenizer, resolve_model_path
        from raylign.rollout.pool import RolloutPool, launch_engines
        from raylign.rollout.rewards import build_reward
        from raylign.rl.group import WorkerGroup

        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, self.out / "config.yaml")
        _seed(cfg.train.seed)
        self.model_path = str(resolve_model_path(cfg.model.path))
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or self.model_path, padding_side="left")
        self.train_prompts = load_prompts(cfg.data.train, cfg.data, self.tokenizer)
        self.eval_prompts = load_prompts(cfg.data.eval, cfg.data, self.tokenizer) if cfg.data.eval else []
        if len(self.train_prompts) < cfg.train.prompts_per_step:
            raise ValueError(f"train.prompts_per_step ({cfg.train.prompts_per_step}) is larger than the prompt set "
                             f"({len(self.train_prompts)} prompts)")
        self.sampler = ResumableSampler(len(self.train_prompts), cfg.train.prompts_per_step, shuffle=True,
                                        seed=cfg.data.seed, drop_last=True)
        # The engines need room for what this run generates, no more.
        longest = max(len(p.token_ids) for p in self.train_prompts + self.eval_prompts)
        new_tokens = max(cfg.sampling.max_new_tokens, cfg.train.eval_max_new_tokens or 0)
        cfg = self.cfg = cfg.model_copy(update={"rollout": cfg.rollout.with_room_for(longest, new_tokens)})
        log.info("rollout.max_model_len: %d (longest prompt %d, %d new tokens)", cfg.rollout.max_model_len,
                 longest, new_tokens)
        # Every actor must fit, or its start waits for a CPU slot until placement.startup_timeout_s.
        local_cpus = cfg.placement.num_cpus or max(1, math.ceil(cfg.ray_cpus_needed))
        self._started_ray = start_ray(cfg.placement.ray_address,
                                      num_cpus=None if cfg.placement.ray_address else local_cpus)
        timeout = cfg.placement.startup_timeout_s
        self.reward = build_reward(cfg.reward, timeout)
        dump = cfg.model_dump(mode="json")
        dump["model"]["path"] = self.model_path
        updates = cfg.train.max_steps * cfg.train.mini_batches * cfg.train.ppo_epochs
        p = cfg.placement
        roles = cfg.worker_roles
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        has_gpus = cluster_gpus > 0
        if has_gpus:
            check_gpu_count(cfg, cluster_gpus)
        self.placement_groups = placement_groups(cfg, has_gpus)
        for role, workers in roles.items():
            group = self.placement_groups[0 if p.colocate else list(roles).index(role)]
            # Colocated on GPUs: rank r of every role shares GPU r (the policy with its engine) in equal parts.
            gpus = (1.0 / len(roles) if p.colocate else 1.0) if has_gpus else 0.0
            self.groups[role] = WorkerGroup(role, dump, workers, updates, group, num_cpus=p.cpus_per_worker,
                                            num_gpus=gpus, startup_timeout_s=timeout)
        if p.colocate:
            # The hybrid engine: each policy worker generates with an engine in its own process.
            self.groups["policy"].call("start_local_engine", self.model_path)
            self.engines = []
            self.pool = RolloutPool(self.groups["policy"].workers)
        else:
            self.engines = launch_engines(self.model_path, cfg.rollout, startup_timeout_s=timeout)
            self.pool = RolloutPool(self.engines)
            self.groups["policy"].call("connect_engines", self.engines)
        self.metrics = MetricsLogger(self.out, cfg.train.logging, dump)
        self._maybe_resume()

    def _maybe_resume(self) -> None:
        ckpt = latest_checkpoint(self.out / "checkpoints") if self.cfg.train.resume else None
        if ckpt is None:
            return
        for role in ("policy", "critic"):
            if role in self.groups:
                self.groups[role].call("load_checkpoint", str(ckpt / role))
        state = torch.load(ckpt / "controller.pt", weights_only=False)
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self._next_indices = state.get("next_indices")  # generated again, with the restored weights
        _set_rng(state["rng"])
        self.sync_weights()
        log.info("resumed from %s at step %d", ckpt, self.step)

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> dict[str, float]:
        self.setup()
        cfg = self.cfg
        try:
            if self.step == 0 and self.eval_prompts:
                self.evaluate()
            progress = Progress(cfg.train.max_steps, "rl", enabled=cfg.train.logging.progress_bar)
            progress.advance_to(self.step)
            batches = _endless(self.sampler)
            metrics: dict[str, float] = {}
            while self.step < cfg.train.max_steps:
                indices = self._next_indices if self._next_indices is not None else next(batches)
                self._next_indices = None
                metrics = self.train_step(indices, batches)
                self.step += 1
                self.metrics.log(metrics, self.step)
                progress.advance_to(self.step, format_metrics(metrics, ["reward/mean", "response_length/mean",
                                                                        "time/step_s"]))
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0 and self.step < cfg.train.max_steps:
                    self.evaluate()
                if cfg.train.save_every and self.step % cfg.train.save_every == 0:
                    self.save_checkpoint()
            progress.close()
            final = self.evaluate() if self.eval_prompts else {}
            if not (cfg.train.save_every and self.step % cfg.train.save_every == 0):
                self.save_checkpoint()
            if cfg.train.export:
                self.groups["policy"].call("export_hf", str(self.out / "final"))
                log.info("exported the final policy to %s", self.out / "final")
            self._plot()
            return {**metrics, **final}
        finally:
            self.shutdown()

    def train_step(self, indices: list[int], more_batches) -> dict[str, float]:
        """One RL step on the prompts at ``indices``. With ``train.async_rollout`` the next step's
        generation runs on the engines from the end of this step's rollout until just before the
        weight sync, overlapping experience and training."""
        cfg = self.cfg
        timings: dict[str, float] = {}
        start = time.perf_counter()
        samples, gen_metrics = self.rollout([self.train_prompts[i] for i in indices], more_batches, timings)
        if cfg.train.async_rollout and self.step + 1 < cfg.train.max_steps:
            self._next_indices = next(more_batches)
            self._ahead = self.pool.submit([self.train_prompts[i].token_ids for i in self._next_indices],
                                           cfg.sampling)
        t = time.perf_counter()
        self._make_room_for("training")
        exp = self.make_experience(samples)
        timings["time/experience_s"] = time.perf_counter() - t
        t = time.perf_counter()
        train_metrics = self.update(samples, exp)
        timings["time/train_s"] = time.perf_counter() - t
        if self._ahead is not None:  # the engines must be idle before their weights change
            t = time.perf_counter()
            self._prefetched = self._samples(self.pool.collect(self._ahead),
                                             [self.train_prompts[i] for i in self._next_indices])
            self._ahead = None
            timings["time/generate_s"] += time.perf_counter() - t
        t = time.perf_counter()
        sync_metrics = self.sync_weights()
        timings["time/sync_s"] = time.perf_counter() - t
        elapsed = time.perf_counter() - start
        self._write_samples(samples)
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        generated = sum(len(s.response_ids) for s in samples)
        return {**gen_metrics, **exp["metrics"], **train_metrics, **sync_metrics, **timings,
                "time/step_s": elapsed, "throughput/tokens_per_s": tokens / elapsed,
                "throughput/generated_tokens_per_s": generated / max(timings["time/generate_s"], 1e-9)}

    # ---- rollout and rewards ---------------------------------------------------------------

    def generate(self, prompts: list[Prompt], sampling) -> list[Sample]:
        return self._samples(self.pool.generate_blocking([p.token_ids for p in prompts], sampling), prompts)

    @staticmethod
    def _samples(completions: list, prompts: list[Prompt]) -> list[Sample]:
        samples = []
        for c in completions:
            p = prompts[c.prompt_index]
            samples.append(Sample(c.prompt_token_ids, c.response_token_ids, c.response_logprobs, c.prompt_index,
                                  p.text, c.text, p.label, p.source, c.finish_reason,
                                  weight_version=c.weight_version))
        return samples

    def score(self, samples: list[Sample]) -> None:
        result = self.reward.score([s.prompt_text for s in samples], [s.response_text for s in samples],
                                   [s.label for s in samples], [{"source": s.source} for s in samples])
        for i, s in enumerate(samples):
            s.reward = float(result.rewards[i])
            s.reward_metrics = {k: float(v[i]) for k, v in result.metrics.items()}

    def rollout(self, prompts: list[Prompt], more_batches, timings: dict[str, float]) -> tuple[list[Sample], dict]:
        cfg, n = self.cfg, self.cfg.sampling.n
        t = time.perf_counter()
        self._make_room_for("generation")
        if self._prefetched is not None:  # generated during the previous step (train.async_rollout)
            samples, self._prefetched = self._prefetched, None
        else:
            samples = self.generate(prompts, cfg.sampling)
        timings["time/generate_s"] = time.perf_counter() - t
        t = time.perf_counter()
        self.score(samples)
        timings["time/reward_s"] = time.perf_counter() - t
        metrics = {**reward_metrics(samples), "rollout/weight_lag": float(self.syncs - min(
            s.weight_version for s in samples))}
        if not cfg.algorithm.dynamic_sampling:
            return samples, metrics
        kept, dropped = split_by_reward_variance(samples, n)
        metrics["dynamic_sampling/kept_groups_first_round"] = len(kept) / n
        rounds = 0
        while len(kept) < len(prompts) * n and rounds < cfg.algorithm.max_refill_rounds:
            rounds += 1
            extra_prompts = [self.train_prompts[i] for i in next(more_batches)]
            t = time.perf_counter()
            extra = self.generate(extra_prompts, cfg.sampling)
            timings["time/generate_s"] += time.perf_counter() - t
            t = time.perf_counter()
            self.score(extra)
            timings["time/reward_s"] += time.perf_counter() - t
            more_kept, more_dropped = split_by_reward_variance(extra, n)
            kept += more_kept
            dropped += more_dropped
        short = max(0, len(prompts) * n - len(kept))
        # Too few informative groups after the refills: top up with dropped groups (their advantages are 0).
        chosen = (kept + dropped[:short])[: len(prompts) * n]
        for g in range(len(chosen) // n):
            for s in chosen[g * n:(g + 1) * n]:
                s.group = g
        metrics.update({"dynamic_sampling/refill_rounds": rounds, "dynamic_sampling/short_groups": short / n})
        return chosen, metrics

    # ---- experience ----------------------------------------------------------------------

    def _forward_all(self, role: str, method: str, samples: list[Sample]) -> torch.Tensor:
        """Run ``method`` over all samples, sharded across the role's ranks; ``[B, R]`` in sample order."""
        group = self.groups[role]
        plan = micro_batches_for_ranks(samples, len(group), self.cfg.train.micro_batch_tokens)
        rows = self.cfg.train.pack_row_tokens
        per_rank = [[pack_samples([samples[i] for i in micro], row_tokens=rows) for micro in rank_plan]
                    for rank_plan in plan]
        results = group.call_sharded(method, per_rank)
        out = torch.zeros(len(samples), max(len(s.response_ids) for s in samples))
        for rank_plan, rank_results in zip(plan, results):
            for micro, values in zip(rank_plan, rank_results):
                for row, i in enumerate(micro):
                    length = len(samples[i].response_ids)
                    out[i, :length] = values[row, :length]
        return out

    def make_experience(self, samples: list[Sample]) -> dict[str, Any]:
        cfg = self.cfg
        width = max(len(s.response_ids) for s in samples)
        mask = response_mask(samples, width)
        # On-policy updates (one pass over one mini-batch, no off-policy correction) need no separate
        # behaviour forward pass: the policy has not moved since generation, so the training forward's
        # own detached log-probs are the behaviour log-probs (ratio 1). The engine's log-probs stand in
        # for them in the KL-in-reward term; the trainer-vs-engine mismatch is then measured in training.
        old = self._forward_all("policy", "compute_logprobs", samples) if self._needs_behaviour_pass() else None
        ref = self._forward_all("reference", "compute_logprobs", samples) if cfg.uses_reference else None
        values = self._forward_all("critic", "compute_values", samples) if cfg.uses_critic else None
        rollout_lp = response_tensor([s.rollout_logprobs for s in samples], width)
        lengths = mask.sum(dim=-1)
        rewards, shaping = shaped_rewards(torch.tensor([s.reward for s in samples]), lengths, cfg)
        behaviour = old if old is not None else rollout_lp
        advantages, returns, adv_metrics = compute_advantages(cfg, rewards, mask, cfg.sampling.n, behaviour, ref,
                                                              values)
        metrics = {**shaping, **adv_metrics}
        per_token = {"rollout_logprobs": rollout_lp, "advantages": advantages, "returns": returns}
        if old is not None:
            metrics.update(mismatch_metrics(old, rollout_lp, mask))
            per_token["old_logprobs"] = old
        elif cfg.train.async_rollout:  # the weights that generated these samples are gone: the engine's
            per_token["old_logprobs"] = rollout_lp  # log-probs are the behaviour policy
        if ref is not None:
            per_token["ref_logprobs"] = ref
        if values is not None:
            per_token["values"] = values
        return {"per_token": per_token, "metrics": metrics}

    # ---- updates -------------------------------------------------------------------------

    def update(self, samples: list[Sample], exp: dict[str, Any]) -> dict[str, float]:
        cfg = self.cfg
        size = len(samples) // cfg.train.mini_batches
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        count = 0
        for _ in range(cfg.train.ppo_epochs):
            for m in range(cfg.train.mini_batches):
                idx = list(range(m * size, (m + 1) * size))
                for role, method in (("policy", "train_policy"), ("critic", "train_critic")):
                    if role not in self.groups:
                        continue
                    results = self.groups[role].call_sharded(method, self._shard(samples, idx, exp["per_token"],
                                                                                  len(self.groups[role])))
                    for key in results[0]:
                        name = f"{role}/{key}"
                        if "_max" in key:  # a maximum over ranks and updates, not a mean
                            maxes[name] = max([maxes.get(name, -math.inf)] + [r[key] for r in results])
                        else:
                            sums[name] = sums.get(name, 0.0) + sum(r[key] for r in results) / len(results)
                count += 1
        metrics = {**{k: v / count for k, v in sums.items()}, **maxes}
        # On-policy runs measure the engine-vs-trainer mismatch inside the training forward pass.
        for key in ("abs_diff", "max_abs_diff"):
            if f"policy/mismatch_{key}" in metrics:
                metrics[f"mismatch/logprob_{key}"] = metrics.pop(f"policy/mismatch_{key}")
        return metrics

    def _shard(self, samples: list[Sample], idx: list[int], per_token: dict[str, torch.Tensor], world: int):
        chosen = [samples[i] for i in idx]
        plan = micro_batches_for_ranks(chosen, world, self.cfg.train.micro_batch_tokens)
        return [[pack_samples([chosen[j] for j in micro], {k: v[[idx[j] for j in micro]] for k, v in per_token.items()},
                              row_tokens=self.cfg.train.pack_row_tokens)
                 for micro in rank_plan] for rank_plan in plan]

    def _needs_behaviour_pass(self) -> bool:
        t, a = self.cfg.train, self.cfg.algorithm
        if t.async_rollout:
            return False
        return t.ppo_epochs > 1 or t.mini_batches > 1 or a.off_policy != "none"

    def _write_samples(self, samples: list[Sample]) -> None:
        if not self.cfg.train.log_samples:
            return
        with open(self.out / "samples.jsonl", "a") as f:
            for s in samples[: self.cfg.train.log_samples]:
                f.write(json.dumps({"step": self.step + 1, "prompt": s.prompt_text, "response": s.response_text,
                                    "label": s.label, "reward": s.reward, "finish_reason": s.finish_reason},
                                   default=str) + "\n")

    def sync_weights(self) -> dict[str, float]:
        if self.cfg.placement.colocate:
            self.pool.wake_up()
        results = self.groups["policy"].call("sync_weights")
        self.syncs += 1
        return results[0]

    def _make_room_for(self, phase: str) -> None:
        """Colocated placement (the hybrid engine): only one side holds its memory at a time.

        Before generation the training workers offload weights and optimizer state; before
        experience and training the engines in the policy workers sleep (free weights and KV
        cache; a no-op where the engine cannot sleep, e.g. vLLM on CPU). They wake up for the next
        weight sync."""
        if not self.cfg.placement.colocate:
            return
        for group in self.groups.values():
            group.call("offload" if phase == "generation" else "onload")
        if phase == "training":
            self.pool.sleep()

    # ---- evaluation, checkpoints ---------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        cfg = self.cfg
        sampling = cfg.sampling.model_copy(update={
            "n": cfg.train.eval_n, "temperature": cfg.train.eval_temperature,
            "max_new_tokens": cfg.train.eval_max_new_tokens or cfg.sampling.max_new_tokens})
        samples = self.generate(self.eval_prompts, sampling)
        self.score(samples)
        metrics = pass_at_k_metrics(samples, cfg.train.eval_n, cfg.train.eval_threshold)
        self.metrics.log(metrics, self.step)
        log.info("step %d eval: %s", self.step, format_metrics(metrics))
        return metrics

    def save_checkpoint(self) -> Path:
        root = self.out / "checkpoints"
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "rng": _get_rng(),
                 "next_indices": self._next_indices}

        def write(tmp: Path) -> None:
            for role in ("policy", "critic"):
                if role in self.groups:
                    self.groups[role].call("save_checkpoint", str(tmp / role), {"step": self.step})
            torch.save(state, tmp / "controller.pt")

        path = write_atomically(step_directory(root, self.step), write, {"step": self.step})
        prune_checkpoints(root, self.cfg.train.keep_last)
        log.info("saved checkpoint %s", path)
        return path

    def _plot(self) -> None:
        from raylign.trainers.plots import plot_metric

        try:
            path = plot_metric(self.out, "reward/mean", self.out / "reward_curve.png", title="mean reward per step")
            log.info("reward curve: %s", path)
        except ValueError as err:
            log.warning("no reward curve: %s", err)

    def shutdown(self) -> None:
        import ray

        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "reward"):
            self.reward.close()
        for group in self.groups.values():
            group.kill()
        for engine in getattr(self, "engines", []):
            ray.kill(engine)
        for group in getattr(self, "placement_groups", []):
            ray.util.remove_placement_group(group)
        if getattr(self, "_started_ray", False):
            ray.shutdown()


def _endless(sampler: ResumableSampler):
    while True:
        yield from sampler


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _get_rng() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def run_rl(cfg: RLConfig) -> dict[str, float]:
    return RLTrainer(cfg).run()
