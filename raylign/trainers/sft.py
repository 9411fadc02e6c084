"""Supervised fine-tuning: next-token cross-entropy on the target tokens of each sample.

Target tokens are the assistant turns (chat data), the output (prompt/output data), or
every token (``data.loss: full``, pretraining mode). The loss is the mean over all
target tokens of the global batch.

With ``engine.sequence_parallel_size`` n > 1 each packed micro-batch row is cut into n chunks,
one per rank of a sequence-parallel group, and the model runs ring attention across them
(:mod:`raylign.models.sequence_parallel`). A rank's loss is the sum over its chunk's targets and
its units their count, so the loop's global normaliser and gradient averaging give the same
update as one rank holding the whole row.
"""

from __future__ import annotations

from typing import Any

import torch

from raylign.config.commands import SFTConfig
from raylign.data import build_sft_datasets, collate_packed, collate_padded
from raylign.models import load_causal_lm, load_tokenizer, loads_sharded, selected_token_logprobs
from raylign.models.sequence_parallel import shard_packed_batch, sharded_target_logprobs
from raylign.trainers.loop import Batch, OfflineTrainer, data_stats_dict


class SFTTrainer(OfflineTrainer):
    name = "sft"
    cfg: SFTConfig

    def build_tokenizer(self):
        m = self.cfg.model
        return load_tokenizer(m.tokenizer_path or m.path, padding_side="right")

    def build_model(self) -> torch.nn.Module:
        return load_causal_lm(self.model_config(self.cfg.model), empty=loads_sharded(self.cfg.model, self.cfg.engine))

    def build_datasets(self) -> tuple[list, list, dict[str, Any]]:
        data = build_sft_datasets(self.cfg.data, self.tokenizer)
        return data.train, data.eval, data_stats_dict(data.stats)

    def collate(self, samples: list) -> Batch:
        pad = self.tokenizer.pad_token_id
        if self.sp_size > 1:  # one row holding every sample, which the group then cuts into chunks
            row = sum(len(s.input_ids) for s in samples)
            return shard_packed_batch(collate_packed(samples, pad, row_tokens=row), self.sp_rank, self.sp_size, pad)
        if self.cfg.data.packing:
            return collate_packed(samples, pad, self.row_tokens)
        return collate_padded(samples, pad)

    def batch_units(self, batch: Batch) -> float:
        return float(batch["target_mask" if "target_mask" in batch else "loss_mask"].sum())

    def compute_loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        if "target_mask" in batch:  # this rank's chunk of a row shared by its sequence-parallel group
            return -sharded_target_logprobs(model, batch, self.sp_group, self.collective_timeout).sum(), {}
        # The output layer and its softmax run at the trained tokens only (prompts and padding skip both).
        weights = batch["loss_mask"].reshape(-1)
        targets = weights.nonzero().flatten()
        if not targets.numel():  # nothing to train here: one position, weighted 0, keeps every weight in the graph
            targets = torch.ones(1, dtype=torch.long, device=weights.device)
        logprobs = selected_token_logprobs(
            model,
            batch["input_ids"],
            targets,
            position_ids=batch.get("position_ids"),
            attention_mask=batch.get("attention_mask"),
        )
        return -(logprobs * weights[targets].float()).sum(), {}


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    return SFTTrainer(cfg).run()
