"""Preference optimisation of a causal LM: DPO, cDPO, IPO, DPO+NLL, SimPO and ORPO.

Each pair is two sequences, prompt + chosen and prompt + rejected, run through the policy in
one forward pass; a response's log-probability is the sum over its scored tokens. Losses
that compare with a frozen reference model get the reference's log-probs either from a live
reference forward every step or, with ``dpo.precompute_reference``, from one pass over all
pairs before training (each rank computes its share, the ranks share them, and the reference
model is freed). The reference is sharded like the policy with fsdp2 on several ranks
(:func:`raylign.engine.load_frozen`), else a whole copy on every rank; a LoRA policy's reference is
the policy itself with its adapters off. SimPO and ORPO use no reference, and none is built. The
unit of the loss is the pair.

ORPO's NLL term is taken per pair (the mean over pairs of each chosen response's per-token
average NLL) so that it sums over micro-batches like every other term.
"""

from __future__ import annotations

import gc
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from raylign.algorithms import PREFERENCE_LOSSES
from raylign.config.dpo import DPOConfig
from raylign.data.preference import PairSample, build_pair_datasets, collate_pairs, num_pairs
from raylign.engine.distributed import all_reduce_scalars
from raylign.models import load_causal_lm, load_tokenizer, loads_sharded, sequence_logprobs
from raylign.models.packed_attention import ONE_ROW
from raylign.trainers.loop import Batch, OfflineTrainer, data_stats_dict

log = logging.getLogger("raylign")

# config field -> keyword of the loss function
_OPTION_KWARGS = {
    "beta": "beta",
    "label_smoothing": "label_smoothing",
    "simpo_gamma": "gamma",
    "nll_coef": "nll_coef",
    "orpo_lambda": "lam",
}


@dataclass
class ReferencedPair:
    """A pair with the reference model's summed log-probs of its chosen and rejected responses."""

    pair: PairSample
    ref_chosen_logp: float
    ref_rejected_logp: float

    @property
    def source(self) -> str:  # where the pair came from, for diagnostics that name rows
        return self.pair.source

    @property
    def row(self) -> int:
        return self.pair.row

    @property
    def num_tokens(self) -> int:  # the tokens the policy trains on, for throughput
        return self.pair.num_tokens


def sequence_logps(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Summed log-probs of the scored tokens of every sequence of a :func:`collate_pairs` batch, float32 ``[2B]``."""
    return sequence_logprobs(
        model,
        batch["input_ids"],
        batch["loss_mask"],
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
        seq_starts=batch.get("seq_starts"),
        seq_lens=batch.get("seq_lens"),
    )


def loss_kwargs(cfg: DPOConfig) -> dict[str, float]:
    """Keyword options for the configured loss; unset ones keep the loss function's defaults."""
    return {
        kwarg: getattr(cfg.dpo, field) for field, kwarg in _OPTION_KWARGS.items() if getattr(cfg.dpo, field) is not None
    }


class DPOTrainer(OfflineTrainer):
    name = "dpo"
    cfg: DPOConfig

    def __init__(self, cfg: DPOConfig):
        super().__init__(cfg)
        self.loss_fn = PREFERENCE_LOSSES.get(cfg.dpo.loss)
        self.uses_reference = bool(PREFERENCE_LOSSES.metadata(cfg.dpo.loss).get("uses_reference"))
        self.loss_kwargs = loss_kwargs(cfg)
        self.length_params = set(inspect.signature(self.loss_fn).parameters) & {"chosen_lengths", "rejected_lengths"}
        self.reference: torch.nn.Module | None = None

    def build_tokenizer(self):
        m = self.cfg.model
        return load_tokenizer(m.tokenizer_path or m.path, padding_side="right")

    def build_model(self) -> torch.nn.Module:
        return load_causal_lm(self.model_config(self.cfg.model), empty=loads_sharded(self.cfg.model, self.cfg.engine))

    def build_datasets(self) -> tuple[list, list, dict[str, Any]]:
        data = build_pair_datasets(self.cfg.data, self.tokenizer)
        return data.train, data.eval, data_stats_dict(data.stats)

    # ---- the reference model -----------------------------------------------------------

    def on_setup(self) -> None:
        if not self.uses_reference:
            return
        self.reference = self.load_reference(self.cfg.dpo.reference_path)
        if self.cfg.dpo.precompute_reference:
            self.train_samples = self._attach_reference_logps(self.train_samples)
            self.eval_samples = self._attach_reference_logps(self.eval_samples)
            self.reference = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _attach_reference_logps(self, samples: list[PairSample]) -> list[ReferencedPair]:
        """Reference log-probs of every pair, computed as evaluation runs: data-parallel rank ``r`` takes
        pairs ``r::ranks``, every rank as many batches (a sharded reference's forward is collective; a
        rank out of pairs runs a stand-in); the first rank of each group that shares its batches
        contributes them to a sum over the ranks, which gives every rank all of them."""
        values = [0.0] * (2 * len(samples))
        mine = list(range(self.dp_rank, len(samples), self.dp_size))
        size = self.train_cfg.eval_batch_size
        num_batches = math.ceil(math.ceil(len(samples) / self.dp_size) / size)
        contributes = self.rank % (self.world_size // self.dp_size) == 0
        for j in range(num_batches):
            indices = mine[j * size : (j + 1) * size]
            batch = self._to_device(self.collate([samples[i] for i in indices] or samples[:1]))
            logps = self._reference_logps(self.engine.module, batch).tolist()
            if contributes:
                for k, i in enumerate(indices):
                    values[2 * i], values[2 * i + 1] = logps[k], logps[len(indices) + k]
        values = all_reduce_scalars(values, op="sum")
        if self.is_main and samples:
            log.info("computed the reference log-probs of %d pairs", len(samples))
        return [ReferencedPair(s, values[2 * i], values[2 * i + 1]) for i, s in enumerate(samples)]

    def _collate_pairs(self, pairs: list[PairSample]) -> Batch:
        data = self.cfg.data
        return collate_pairs(pairs, self.tokenizer.pad_token_id, packed=data.packing, row_tokens=self.row_tokens)

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.engine.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _reference_logps(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        if "reference_logps" in batch:
            return batch["reference_logps"]
        return self.frozen_forward(self.reference, model, lambda m: self._logps(m, batch))

    def _logps(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        if "target_mask" in batch:  # this rank's chunk of a row shared by its sequence-parallel group
            return self.sharded_sequence_logps(model, batch)
        return sequence_logps(model, batch)

    # ---- hooks of the loop -------------------------------------------------------------

    def collate(self, samples: list) -> Batch:
        pairs = [s.pair if isinstance(s, ReferencedPair) else s for s in samples]
        if self.sp_size > 1:  # one row holding every sequence, which the group then cuts into chunks
            batch = self.shard_sequences(collate_pairs(pairs, self.tokenizer.pad_token_id, True, ONE_ROW))
        else:
            batch = self._collate_pairs(pairs)
        if samples and isinstance(samples[0], ReferencedPair):
            logps = [s.ref_chosen_logp for s in samples] + [s.ref_rejected_logp for s in samples]
            batch["reference_logps"] = torch.tensor(logps, dtype=torch.float32)
        return batch

    def batch_units(self, batch: Batch) -> float:
        return float(num_pairs(batch))

    def compute_loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        n = num_pairs(batch)
        policy = self._logps(model, batch)
        inputs, length_kwargs = self._policy_inputs(policy, batch["response_lengths"], n)
        if self.uses_reference:
            reference = self._reference_logps(model, batch)
            inputs += [reference[:n], reference[n:]]
        loss, metrics = self.loss_fn(*inputs, **self.loss_kwargs, **length_kwargs)
        sums = {key: float(value) * n for key, value in metrics.items()}
        chosen, rejected = policy[:n].detach(), policy[n:].detach()
        sums.update(
            logps_chosen=float(chosen.sum()),
            logps_rejected=float(rejected.sum()),
            logps_margin=float((chosen - rejected).sum()),
        )
        # loss functions return means over the micro-batch's pairs; the loop wants sums
        return loss * n, sums

    def _policy_inputs(
        self, policy: torch.Tensor, lengths: torch.Tensor, n: int
    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """(chosen, rejected) policy log-probs and the response lengths for losses that average per token."""
        if self.cfg.dpo.loss == "orpo":
            # per-token averages instead of sums plus lengths: ORPO's NLL then is a per-pair mean
            return [policy[:n] / lengths[:n].clamp(min=1), policy[n:] / lengths[n:].clamp(min=1)], {}
        given = {"chosen_lengths": lengths[:n], "rejected_lengths": lengths[n:]}
        return [policy[:n], policy[n:]], {k: v for k, v in given.items() if k in self.length_params}


def run_dpo(cfg: DPOConfig) -> dict[str, float]:
    return DPOTrainer(cfg).run()
