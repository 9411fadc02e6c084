"""Reward-model training: a one-output score head on the LM, fitted to preference pairs.

Each pair is two sequences, prompt + chosen and prompt + rejected, scored at their last
token; the loss is Bradley-Terry on the two scores (optionally with a per-pair margin).
The unit of the loss is the pair. After training, the mean and standard deviation of the
model's scores over the training pairs (both sides, population std) go into the exported
``config.json`` as ``raylign_reward_mean`` / ``raylign_reward_std``, which the RL reward
source uses to normalise rewards.

With ``engine.sequence_parallel_size`` n > 1 the ranks of a group share every micro-batch, its
sequences packed into one row cut into n chunks with ring attention between them; a sequence's score
is read by the rank whose chunk holds its last token and all-reduced
(:func:`raylign.models.sequence_parallel.sharded_scores_at`), so every rank of the group computes the
same loss over the same pairs, as in :mod:`raylign.trainers.dpo`.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from raylign.algorithms import REWARD_MODEL_LOSSES
from raylign.config.rm import RMConfig
from raylign.data.preference import PairSample, build_pair_datasets, collate_pairs, num_pairs
from raylign.engine.distributed import all_reduce_scalars
from raylign.models import load_score_model, load_tokenizer, loads_sharded
from raylign.models.heads import HEAD_NAME
from raylign.models.packed_attention import ONE_ROW
from raylign.models.packing import attention_kwargs
from raylign.models.sequence_parallel import sharded_scores_at
from raylign.trainers.loop import Batch, OfflineTrainer, data_stats_dict

log = logging.getLogger("raylign")

MEAN_KEY = "raylign_reward_mean"
STD_KEY = "raylign_reward_std"


def score_head(model: torch.nn.Module) -> torch.nn.Module:
    """The ``score`` head of a score model, also inside a DeepSpeed engine or a PEFT wrapper."""
    inner = getattr(model, "module", None)
    model = inner if isinstance(inner, torch.nn.Module) else model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(base, HEAD_NAME, None)
    if not isinstance(head, torch.nn.Module):
        raise TypeError(f"{type(base).__name__} has no '{HEAD_NAME}' head")
    return head


@contextmanager
def _capture_output(module: torch.nn.Module):
    captured: dict[str, torch.Tensor] = {}
    handle = module.register_forward_hook(lambda _m, _inputs, output: captured.__setitem__("output", output))
    try:
        yield captured
    finally:
        handle.remove()


def last_token_scores(model: torch.nn.Module, head: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Score of every sequence of a :func:`collate_pairs` batch at its last token, float32 ``[2B]``.

    Runs the model's own forward and reads the head's per-position output with a hook: FSDP2
    gathers the root's weights (embeddings, final norm, head) only in the root forward, so
    calling the backbone and the head separately would meet sharded weights.
    """
    with _capture_output(head) as captured:
        model(input_ids=batch["input_ids"], **attention_kwargs(batch.get("attention_mask"), batch.get("position_ids")))
    scores = captured["output"].squeeze(-1).float()
    if "seq_lens" in batch:  # packed: sample i ends at flat position seq_starts[i] + seq_lens[i] - 1
        return scores.reshape(-1)[batch["seq_starts"] + batch["seq_lens"] - 1]
    last = batch["attention_mask"].sum(-1) - 1  # right padded
    return scores[torch.arange(scores.shape[0], device=scores.device), last]


class RMTrainer(OfflineTrainer):
    name = "rm"
    cfg: RMConfig

    def build_tokenizer(self):
        m = self.cfg.model
        return load_tokenizer(m.tokenizer_path or m.path, padding_side="right")

    def build_model(self) -> torch.nn.Module:
        empty = loads_sharded(self.cfg.model, self.cfg.engine)
        return load_score_model(self.model_config(self.cfg.model), num_labels=1, empty=empty)

    def build_datasets(self) -> tuple[list, list, dict[str, Any]]:
        data = build_pair_datasets(self.cfg.data, self.tokenizer, margin_key=self.cfg.rm.margin_key)
        return data.train, data.eval, data_stats_dict(data.stats)

    def on_setup(self) -> None:
        self.head = score_head(self.engine.module)
        self.loss_fn = REWARD_MODEL_LOSSES.get(self.cfg.rm.loss)
        self.loss_kwargs = {"center_coef": self.cfg.rm.center_coef} if self.cfg.rm.loss == "bradley_terry" else {}

    def collate(self, samples: list) -> Batch:
        data = self.cfg.data
        if self.sp_size == 1:
            pad = self.tokenizer.pad_token_id
            return collate_pairs(samples, pad, packed=data.packing, row_tokens=self.row_tokens)
        # One row holding every sequence, which the group then cuts into chunks; each sequence's last token
        # is recorded as its position in that row first.
        whole = collate_pairs(samples, self.tokenizer.pad_token_id, packed=True, row_tokens=ONE_ROW)
        whole["sequence_ends"] = whole["seq_starts"] + whole["seq_lens"] - 1
        return self.shard_sequences(whole)

    def _scores(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        if "sequence_ends" in batch:  # this rank's chunk of a row shared by its sequence-parallel group
            return sharded_scores_at(model, batch, batch["sequence_ends"], self.sp_group, self.collective_timeout)
        return last_token_scores(model, self.head, batch)

    def batch_units(self, batch: Batch) -> float:
        return float(num_pairs(batch))

    def compute_loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        n = num_pairs(batch)
        scores = self._scores(model, batch)
        loss, metrics = self.loss_fn(scores[:n], scores[n:], margin=batch.get("margin"), **self.loss_kwargs)
        # the loss function returns means over the micro-batch's pairs; the loop wants sums
        return loss * n, {key: float(value) * n for key, value in metrics.items()}

    @torch.no_grad()
    def train_score_stats(self) -> tuple[float, float]:
        """Mean and population std of the scores of both sides of every distinct training pair (collective).

        The ranks of a tensor- or sequence-parallel group score the same pairs, so each pair is counted
        once per rank of its group: the mean and std are unchanged."""
        self.engine.eval()
        distinct = list({id(s): s for s in self.train_samples}.values())
        total = sum_sq = count = 0.0
        size = self.train_cfg.eval_batch_size
        for samples, real in _equal_batch_counts(distinct, self.dp_rank, self.dp_size, size):
            collated = {
                k: v.to(self.engine.device) if isinstance(v, torch.Tensor) else v
                for k, v in self.collate(samples).items()
            }
            scores = self._scores(self.engine.module, collated).double()
            if real:
                total += float(scores.sum())
                sum_sq += float(scores.square().sum())
                count += scores.numel()
        self.engine.train()
        total, sum_sq, count = all_reduce_scalars([total, sum_sq, count], op="sum")
        mean = total / count
        return mean, math.sqrt(max(sum_sq / count - mean * mean, 0.0))

    def export(self) -> Path:
        mean, std = self.train_score_stats()
        config = self.engine.hf_model.config
        if hasattr(self.engine.hf_model, "get_base_model"):
            config = self.engine.hf_model.get_base_model().config
        setattr(config, MEAN_KEY, mean)
        setattr(config, STD_KEY, std)
        if self.is_main:
            log.info("reward statistics over the training pairs: mean %.4f, std %.4f", mean, std)
            self.metrics.log({"train/reward_mean": mean, "train/reward_std": std}, self.step)
        return super().export()


def _equal_batch_counts(samples: list[PairSample], rank: int, world_size: int, batch_size: int):
    """This rank's share of ``samples`` in batches, as ``(batch, is_real)``.

    Every rank yields the same number of batches (a sharded model's forward is collective);
    a rank that runs out repeats a sample in a batch marked not real.
    """
    mine = samples[rank::world_size]
    most = math.ceil(len(samples) / world_size)
    for start in range(0, most, batch_size):
        chunk = mine[start : start + batch_size]
        yield (chunk, True) if chunk else ([samples[0]], False)


def run_rm(cfg: RMConfig) -> dict[str, float]:
    return RMTrainer(cfg).run()
