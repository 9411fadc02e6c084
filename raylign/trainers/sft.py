"""Supervised fine-tuning: next-token cross-entropy on the target tokens of each sample.

Target tokens are the assistant turns (chat data), the output (prompt/output data), or
every token (``data.loss: full``, pretraining mode). The loss is the mean over all
target tokens of the global batch.
"""

from __future__ import annotations

from typing import Any

import torch

from raylign.config.commands import SFTConfig
from raylign.data import build_sft_datasets, collate_packed, collate_padded
from raylign.models import load_causal_lm, load_tokenizer, token_logprobs
from raylign.trainers.loop import Batch, OfflineTrainer, data_stats_dict


class SFTTrainer(OfflineTrainer):
    name = "sft"
    cfg: SFTConfig

    def build_tokenizer(self):
        m = self.cfg.model
        return load_tokenizer(m.tokenizer_path or m.path, padding_side="right")

    def build_model(self) -> torch.nn.Module:
        return load_causal_lm(self.cfg.model)

    def build_datasets(self) -> tuple[list, list, dict[str, Any]]:
        data = build_sft_datasets(self.cfg.data, self.tokenizer)
        return data.train, data.eval, data_stats_dict(data.stats)

    def collate(self, samples: list) -> Batch:
        if self.cfg.data.packing:
            return collate_packed(samples)
        return collate_padded(samples, self.tokenizer.pad_token_id)

    def batch_units(self, batch: Batch) -> float:
        return float(batch["loss_mask"].sum())

    def compute_loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs = token_logprobs(
            model,
            batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
        )
        mask = batch["loss_mask"].to(logprobs.dtype)
        return -(logprobs.float() * mask).sum(), {}


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    return SFTTrainer(cfg).run()
