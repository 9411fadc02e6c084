"""Preference optimisation of a causal LM: DPO, cDPO, IPO, DPO+NLL, SimPO and ORPO.

Each pair is two sequences, prompt + chosen and prompt + rejected, run through the policy in
one forward pass; a response's log-probability is the sum over its scored tokens. Losses
that compare with a frozen reference model get the reference's log-probs either from a live
reference forward every step or, with ``dpo.precompute_reference``, from one pass over all
pairs before training (each rank computes its share, the ranks share them, and the reference
model is freed). A live reference is sharded like the policy with fsdp2 on several ranks
(:func:`raylign.engine.load_frozen`), else a whole copy on every rank. SimPO and ORPO use no reference, and none is
built. The unit of the loss is the pair.

ORPO's NLL term is taken per pair (the mean over pairs of each chosen response's per-token
average NLL) so that it sums over micro-batches like every other term.
"""

from __future__ import annotations

import gc
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch

from raylign.algorithms import PREFERENCE_LOSSES
from raylign.config.dpo import DPOConfig
from raylign.config.model import ModelConfig
from raylign.data.preference import PairSample, build_pair_datasets, collate_pairs, num_pairs
from raylign.engine import load_frozen
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

    def build_reference(self) -> torch.nn.Module:
        """The frozen reference: ``dpo.reference_path`` or the starting model, without LoRA, in eval mode."""
        m = self.cfg.model
        ref_cfg = ModelConfig(
            path=self.cfg.dpo.reference_path or m.path,
            dtype=m.dtype,
            attn_implementation=m.attn_implementation,
            trust_remote_code=m.trust_remote_code,
        )
        if self.cfg.dpo.precompute_reference:
            # Whole on every rank: the ranks compute unequal shares of the pairs, which a sharded
            # model's collective forward cannot do; it is freed once the log-probs are in.
            return load_causal_lm(ref_cfg, device=self.engine.device).eval().requires_grad_(False)
        return load_frozen(self.model_config(ref_cfg), self.cfg.engine, self.engine.device)

    def on_setup(self) -> None:
        if not self.uses_reference:
            return
        self.reference = self.build_reference()
        if self.cfg.dpo.precompute_reference:
            self.train_samples = self._attach_reference_logps(self.train_samples)
            self.eval_samples = self._attach_reference_logps(self.eval_samples)
            self.reference = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    @torch.no_grad()
    def _attach_reference_logps(self, samples: list[PairSample]) -> list[ReferencedPair]:
        """Reference log-probs of every pair: this rank computes pairs ``rank::world_size``; a sum over the
        ranks (each contributes 0 for the pairs it did not compute) gives every rank all of them."""
        values = [0.0] * (2 * len(samples))
        mine = list(range(self.rank, len(samples), self.world_size))
        size = self.train_cfg.eval_batch_size
        for start in range(0, len(mine), size):
            indices = mine[start : start + size]
            batch = self._to_device(self._collate_pairs([samples[i] for i in indices]))
            logps = sequence_logps(self.reference, batch).tolist()
            for j, i in enumerate(indices):
                values[2 * i], values[2 * i + 1] = logps[j], logps[len(indices) + j]
        values = all_reduce_scalars(values, op="sum")
        if self.is_main and samples:
            log.info("computed the reference log-probs of %d pairs", len(samples))
        return [ReferencedPair(s, values[2 * i], values[2 * i + 1]) for i, s in enumerate(samples)]

    def _collate_pairs(self, pairs: list[PairSample]) -> Batch:
        data = self.cfg.data
        return collate_pairs(pairs, self.tokenizer.pad_token_id, packed=data.packing, row_tokens=self.row_tokens)

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.engine.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _reference_logps(self, batch: Batch) -> torch.Tensor:
        if "reference_logps" in batch:
            return batch["reference_logps"]
        with torch.no_grad():
            return self._logps(self.reference, batch)

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
            reference = self._reference_logps(batch)
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
