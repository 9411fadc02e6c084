"""KTO: align a policy with unpaired desirable / undesirable completions.

Per example, the implied reward is ``r = log pi(y|x) - log pi_ref(y|x)`` (summed over the
completion tokens) under a frozen reference model, and the loss (:func:`raylign.algorithms.kto_loss`)
is ``lambda_D (1 - sigma(beta (r - z0)))`` for desirable and ``lambda_U (1 - sigma(beta (z0 - r)))``
for undesirable examples, averaged over all examples of the global batch.

The reference point ``z0`` estimates ``KL(pi || pi_ref)`` on mismatched prompt/completion
pairs (prompt i with completion i-1) of the micro-batch; in training it is averaged over the
micro-batches that the data-parallel ranks run together, so it is taken over
``micro_batch_size x ranks`` examples (as in the paper's per-step batch estimate, which TRL
gathers across processes). It is detached. The reference model is sharded like the policy with
fsdp2 on several ranks (:func:`raylign.engine.load_frozen`), else a whole copy on every rank; a LoRA
policy's reference is the policy itself with its adapters off.

With ``engine.sequence_parallel_size`` n > 1 the ranks of a group share every micro-batch, its
examples (and its mismatched pairs) packed into one row each and cut into n chunks, as in
:mod:`raylign.trainers.dpo`: every rank of the group computes the same loss over the same examples.

Metrics (means per example): ``kl`` (z0), ``reward_signed`` (``beta * r`` with the sign of the
label, which rises as desirable completions gain and undesirable ones lose probability) and
``desirable_fraction``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raylign.algorithms import kto_loss
from raylign.config.kto import KTOConfig
from raylign.data.kto import build_kto_datasets, collate_kto
from raylign.models import load_causal_lm, load_tokenizer, loads_sharded, sequence_logprobs
from raylign.models.packed_attention import ONE_ROW
from raylign.trainers.loop import Batch, OfflineTrainer, data_stats_dict


def completion_logps(model: nn.Module, batch: Batch, prefix: str = "") -> torch.Tensor:
    """Summed completion log-probs of the batch's samples (keys ``prefix + input_ids`` etc.)."""
    return sequence_logprobs(
        model,
        batch[prefix + "input_ids"],
        batch[prefix + "loss_mask"],
        attention_mask=batch.get(prefix + "attention_mask"),
        position_ids=batch.get(prefix + "position_ids"),
        seq_starts=batch.get(prefix + "seq_starts"),
        seq_lens=batch.get(prefix + "seq_lens"),
    )


class KTOTrainer(OfflineTrainer):
    name = "kto"
    cfg: KTOConfig

    def build_tokenizer(self):
        m = self.cfg.model
        return load_tokenizer(m.tokenizer_path or m.path, padding_side="right")

    def build_model(self) -> nn.Module:
        return load_causal_lm(self.model_config(self.cfg.model), empty=loads_sharded(self.cfg.model, self.cfg.engine))

    def build_datasets(self) -> tuple[list, list, dict[str, Any]]:
        data = build_kto_datasets(self.cfg.data, self.tokenizer)
        return data.train, data.eval, {**data_stats_dict(data.stats), **data.label_stats()}

    def on_setup(self) -> None:
        """The frozen reference (:meth:`~raylign.trainers.loop.OfflineTrainer.load_reference`)."""
        self.reference = self.load_reference(self.cfg.kto.reference_path)

    def collate(self, samples: list) -> Batch:
        split = self.sp_size > 1  # then one row of examples (and one of pairs), cut into the group's chunks
        batch = collate_kto(
            samples,
            self.tokenizer.pad_token_id,
            self.cfg.data.packing,
            with_kl_pairs=self.cfg.kto.estimate_kl,
            max_length=self.cfg.data.max_length,
            row_tokens=ONE_ROW if split else self.row_tokens,
        )
        if not split:
            return batch
        batch = self.shard_sequences(batch)
        return self.shard_sequences(batch, "kl_") if self.cfg.kto.estimate_kl else batch

    def _logps(self, model: nn.Module, batch: Batch, prefix: str = "") -> torch.Tensor:
        if prefix + "target_mask" in batch:  # this rank's chunk of a row shared by its sequence-parallel group
            return self.sharded_sequence_logps(model, batch, prefix)
        return completion_logps(model, batch, prefix)

    def batch_units(self, batch: Batch) -> float:
        return float(batch["desirable"].numel())  # examples

    def _kl_process_group(self, model: nn.Module) -> dist.ProcessGroup | None:
        # Ranks run the same number of training micro-batches, so z0 can be averaged over all of
        # them; in evaluation the counts may differ and a collective would hang.
        if self.world_size > 1 and model.training:
            return dist.group.WORLD
        return None

    def compute_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        kto = self.cfg.kto
        policy = self._logps(model, batch)
        reference = self.frozen_forward(self.reference, model, lambda m: self._logps(m, batch))
        policy_kl = reference_kl = None
        desirable = batch["desirable"]
        # One example has no other completion to pair its prompt with (only an evaluation's last batch
        # can be that small; training needs train.micro_batch_size >= 2): z0 = 0 there, as without estimate_kl.
        if kto.estimate_kl and desirable.numel() > 1:
            with torch.no_grad():
                policy_kl = self._logps(model, batch, "kl_")
            reference_kl = self.frozen_forward(self.reference, model, lambda m: self._logps(m, batch, "kl_"))
        loss, metrics = kto_loss(
            policy,
            reference,
            desirable,
            policy_kl_logps=policy_kl,
            ref_kl_logps=reference_kl,
            beta=kto.beta,
            desirable_weight=kto.desirable_weight,
            undesirable_weight=kto.undesirable_weight,
            process_group=self._kl_process_group(model),
        )
        examples = self.batch_units(batch)
        sign = desirable.to(policy.dtype) * 2 - 1
        signed_rewards = (kto.beta * (policy - reference).detach() * sign).sum()
        return loss * examples, {
            "kl": float(metrics["kl"]) * examples,
            "reward_signed": float(signed_rewards),
            "desirable_fraction": float(desirable.sum()),
        }


def run_kto(cfg: KTOConfig) -> dict[str, float]:
    return KTOTrainer(cfg).run()
