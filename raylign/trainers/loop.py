"""The one offline training loop. SFT, RM, PRM, DPO, KTO and KD are hooks on it.

A trainer subclass says how to build its model and data, how to collate a micro-batch,
and how to compute the micro-batch's summed loss. The loop owns everything else:
data-parallel sharding of each global batch, gradient accumulation with a global
normaliser, evaluation, metrics, checkpoints, resume and export.

Loss normalisation: every trainer's loss is a mean over "units" (tokens for SFT, pairs
for DPO, ...). ``compute_loss`` returns the *sum* over its micro-batch's units and
``batch_units`` their count. The loop sums the counts of the whole global batch over all
micro-batches and ranks first, then back-propagates ``loss_sum * world_size / total``
for each micro-batch; data-parallel gradient averaging divides by ``world_size`` again,
so the update equals the one-big-batch gradient of the global mean.

Sequence parallelism (``engine.sequence_parallel_size`` n > 1): the n ranks of a group share every
micro-batch, each running one chunk of its packed rows with ring attention between them; the
helpers below give a trainer the ring-attention model config, its rank's chunk of a batch packed
into one row, and the per-sequence log-prob sums of such a chunk.
"""

from __future__ import annotations

import datetime
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raylign.config.base import Section, save_yaml
from raylign.config.model import LoraConfig, ModelConfig
from raylign.data import ResumableSampler, rank_micro_batches
from raylign.engine import create_engine, load_frozen
from raylign.engine.checkpoint import check_resumes_same_model, check_writable, resume_latest, save_step_checkpoint
from raylign.engine.distributed import (
    all_reduce_scalars,
    barrier,
    init_distributed,
    peak_memory_bytes,
    sequence_parallel_groups,
)
from raylign.engine.optim import check_schedule
from raylign.models.packed_attention import packed_row_tokens, runs_samples_apart
from raylign.models.sequence_parallel import SEQUENCE_ATTENTION, shard_packed_batch, sharded_sequence_logprobs
from raylign.trainers.guard import SkippedSteps
from raylign.trainers.metrics import MetricsLogger, format_metrics
from raylign.trainers.progress import Progress

log = logging.getLogger("raylign")

Batch = dict[str, Any]

# The keys of a packed batch that shard_sequences replaces by this rank's chunk.
_ROW_KEYS = ("input_ids", "loss_mask", "position_ids", "seq_starts", "seq_lens")
_CHUNK_KEYS = ("input_ids", "position_ids", "token_index", "sample_ids", "target_ids", "target_mask", "sequence_ids")


class OfflineTrainer:
    """Base class: subclasses implement the hooks marked below."""

    name = "train"

    def __init__(self, cfg: Section):
        self.cfg = cfg
        self.train_cfg = cfg.train
        self.output_dir = Path(self.train_cfg.output_dir)
        self.step = 0

    # ---- hooks -------------------------------------------------------------------------

    def build_tokenizer(self):
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def build_datasets(self) -> tuple[list, list, dict[str, Any]]:
        """Return (train samples, eval samples, data statistics to log once)."""
        raise NotImplementedError

    def collate(self, samples: list) -> Batch:
        raise NotImplementedError

    def batch_units(self, batch: Batch) -> float:
        """How many loss units (tokens, pairs, ...) this micro-batch holds."""
        raise NotImplementedError

    def compute_loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Summed loss over the micro-batch's units, and metric sums over the same units."""
        raise NotImplementedError

    def on_setup(self) -> None:
        """Called once the engine exists (e.g. to build a frozen reference model)."""

    # ---- a frozen reference, for the trainers that compare with one ------------------------

    def load_reference(self, reference_path: str | None) -> torch.nn.Module | None:
        """The frozen reference: ``reference_path``, else the starting model, loaded without LoRA
        (:func:`raylign.engine.load_frozen`). None for a LoRA policy without ``reference_path``: its
        reference is itself with the adapters off (:meth:`frozen_forward`), which is exactly where it
        starts, a 4-bit base included, and costs no second model."""
        m = self.cfg.model
        if m.lora.rank > 0 and reference_path is None:
            return None
        update = {"path": reference_path or m.path, "lora": LoraConfig(), "gradient_checkpointing": False}
        return load_frozen(self.model_config(m.model_copy(update=update)), self.cfg.engine, self.engine.device)

    def frozen_forward(self, reference: torch.nn.Module | None, model: torch.nn.Module, compute: Any) -> Any:
        """``compute(m)`` without gradients, where ``m`` is ``reference``, or for None (see
        :meth:`load_reference`) the trained ``model`` with its adapters off, in eval mode."""
        with torch.no_grad():
            if reference is not None:
                return compute(reference)
            was_training = model.training
            model.eval()
            try:
                with self.engine.hf_model.disable_adapter():
                    return compute(model)
            finally:
                model.train(was_training)

    # ---- sequence parallelism, for the trainers whose rows it splits ---------------------

    def model_config(self, model: ModelConfig) -> ModelConfig:
        """``model``, with the attention of ``engine.sequence_parallel_mode`` when a sequence-parallel group
        splits its rows."""
        if self.sp_size == 1:
            return model
        return model.model_copy(
            update={"attn_implementation": SEQUENCE_ATTENTION[self.cfg.engine.sequence_parallel_mode]}
        )

    def shard_sequences(self, batch: Batch, prefix: str = "") -> Batch:
        """This rank's chunk of a batch whose sequences are packed into one row (keys ``prefix +
        input_ids``, ``loss_mask``, ``position_ids``, ``seq_starts``, ``seq_lens``), as
        :func:`raylign.models.sequence_parallel.shard_packed_batch` cuts it, under the same prefix,
        with ``num_sequences``; other keys are kept."""
        rows = {key: batch[prefix + key] for key in _ROW_KEYS}
        chunk = shard_packed_batch(rows, self.sp_rank, self.sp_size, self.tokenizer.pad_token_id)
        chunk["num_sequences"] = torch.tensor(rows["seq_lens"].numel())
        replaced = {prefix + key for key in _ROW_KEYS}
        kept = {key: value for key, value in batch.items() if key not in replaced}
        return {**kept, **{prefix + key: value for key, value in chunk.items()}}

    def sharded_sequence_logps(self, model: torch.nn.Module, batch: Batch, prefix: str = "") -> torch.Tensor:
        """Each sequence's summed log-probs of its scored tokens from a :meth:`shard_sequences` chunk,
        float32 ``[num_sequences]``, computed by the rank's sequence-parallel group together."""
        chunk = {key: batch[prefix + key] for key in _CHUNK_KEYS}
        num_sequences = int(batch[prefix + "num_sequences"])
        return sharded_sequence_logprobs(model, chunk, num_sequences, self.sp_group, self.collective_timeout)

    # ---- the loop ----------------------------------------------------------------------

    def setup(self) -> None:
        self.rank, self.world_size, self.device = init_distributed(self.cfg.engine.dist_timeout_s)
        self.is_main = self.rank == 0
        self.collective_timeout = datetime.timedelta(seconds=self.cfg.engine.dist_timeout_s)
        # Ranks of one sequence-parallel group share every micro-batch, each running a chunk of its rows;
        # batches are sharded over the groups. Without sequence parallelism every rank is its own group.
        # Ranks of one tensor-parallel group (consecutive, as the engine's mesh puts them) also share every
        # micro-batch: each computes its slice of every layer on it.
        self.sp_size, self.tp_size = self.cfg.engine.sequence_parallel_size, self.cfg.engine.tensor_parallel_size
        self.sp_group, self.dp_rank, self.dp_size = sequence_parallel_groups(
            self.sp_size, self.cfg.engine.dist_timeout_s, self.tp_size
        )
        self.sp_rank = self.rank // self.tp_size % self.sp_size
        check_resumes_same_model(self.output_dir, self.cfg.model.path, self.train_cfg.resume)  # every rank stops
        if self.is_main:
            check_writable(self.output_dir, "train.output_dir")
            save_yaml(self.cfg, self.output_dir / "config.yaml")
        _seed_everything(self.train_cfg.seed)
        self.tokenizer = self.build_tokenizer()
        self.train_samples, self.eval_samples, data_stats = self.build_datasets()
        if not self.train_samples:
            raise ValueError("the training set is empty after filtering; see the data statistics above")
        self.micro_per_rank = self._micro_batches_per_rank()
        self.total_steps = self._total_steps()
        check_schedule(self.cfg.optim, self.total_steps)  # before the model loads, which can take minutes
        model = self.build_model()
        # 0 (the default) packs a micro-batch into one row where the attention computes packed samples apart
        self.row_tokens = packed_row_tokens(self.cfg.data.pack_row_tokens, runs_samples_apart([self.cfg.model]))
        self.engine = create_engine(model, self.cfg.engine, self.cfg.optim, self.total_steps)
        self.metrics = MetricsLogger(
            self.output_dir, self.train_cfg.logging, self.cfg.model_dump(mode="json"), enabled=self.is_main
        )
        self.skipped = SkippedSteps(self.train_cfg.max_skipped_steps)
        self.sampler = ResumableSampler(
            len(self.train_samples),
            self.train_cfg.global_batch_size,
            shuffle=self.cfg.data.shuffle,
            seed=self.cfg.data.seed,
            drop_last=True,
        )
        self.on_setup()
        if self.is_main:
            log.info("data: %s", format_metrics({k: v for k, v in data_stats.items() if _is_number(v)}))
            log.info(
                "%d train / %d eval samples; %d optimizer steps of %d samples on %d rank(s), %d per row",
                len(self.train_samples),
                len(self.eval_samples),
                self.total_steps,
                self.train_cfg.global_batch_size,
                self.world_size,
                self.sp_size,
            )
        if not self._maybe_resume():  # a resumed run has its data record already
            self.metrics.log({f"data/{k}": v for k, v in data_stats.items() if _is_number(v)}, step=0)

    def _micro_batches_per_rank(self) -> int:
        t = self.train_cfg
        per_rank, rem = divmod(t.global_batch_size, self.dp_size)
        if rem or per_rank % t.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel ranks ({self.dp_size})"
            )
        return per_rank // t.micro_batch_size

    def _total_steps(self) -> int:
        t = self.train_cfg
        per_epoch = len(self.train_samples) // t.global_batch_size
        if per_epoch == 0:  # whether the steps are counted in epochs or given
            raise ValueError(
                f"train.global_batch_size ({t.global_batch_size}) is larger than the training set "
                f"({len(self.train_samples)} samples)"
            )
        if t.max_steps:
            return t.max_steps
        return max(1, math.floor(t.epochs * per_epoch))

    def _maybe_resume(self) -> bool:
        """Continue from the newest checkpoint, if ``train.resume`` and there is one; whether it did."""
        state = resume_latest(self.engine, self.output_dir / "checkpoints") if self.train_cfg.resume else None
        if state is None:  # from step 0: what another run logged here is set aside, not continued
            self.metrics.start_over()
            return False
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        if "skipped" in state:
            self.skipped.load_state_dict(state["skipped"])
        self.metrics.resume_from(self.step, evaluates_again=self.step >= self.total_steps)
        if self.is_main:
            log.info("resumed from the checkpoint of step %d in %s", self.step, self.output_dir / "checkpoints")
        return True

    def run(self) -> dict[str, float]:
        self.setup()
        progress = Progress(
            self.total_steps, f"{self.name}", enabled=self.is_main and self.train_cfg.logging.progress_bar
        )
        progress.advance_to(self.step)
        batches = _endless(self.sampler)
        last_metrics: dict[str, float] = {}
        try:
            while self.step < self.total_steps:
                global_indices = next(batches)
                last_metrics = self.train_step(global_indices)
                self.step += 1
                progress.advance_to(self.step, format_metrics(last_metrics, ["loss", "lr", "tokens_per_s"]))
                if self.step % self.train_cfg.log_every == 0 or self.step == self.total_steps:
                    self.metrics.log({f"train/{k}": v for k, v in last_metrics.items()}, self.step)
                if (
                    self.train_cfg.eval_every
                    and self.step % self.train_cfg.eval_every == 0
                    and self.step < self.total_steps
                ):
                    self.evaluate_and_log()
                if self.train_cfg.save_every and self.step % self.train_cfg.save_every == 0:
                    self.save_checkpoint()
            progress.close()
            final = self.evaluate_and_log()
            if not (self.train_cfg.save_every and self.step % self.train_cfg.save_every == 0):
                self.save_checkpoint()
            if self.train_cfg.export:
                self.export()
        finally:  # a failed run keeps what it logged: every sink flushed, no file left open
            progress.close()
            self.metrics.close()
        return {**{f"train/{k}": v for k, v in last_metrics.items()}, **final}

    def train_step(self, global_indices: list[int]) -> dict[str, float]:
        start = time.perf_counter()
        self.engine.train()
        micro_indices = rank_micro_batches(global_indices, self.dp_rank, self.dp_size, self.train_cfg.micro_batch_size)
        micro_batches = [self.collate([self.train_samples[i] for i in indices]) for indices in micro_indices]
        local_units = sum(self.batch_units(b) for b in micro_batches)
        (total_units,) = all_reduce_scalars([local_units], op="sum")
        if total_units == 0:
            raise ValueError(f"step {self.step + 1}: the global batch has no loss units (every target is masked)")
        sums: dict[str, float] = {}
        not_finite: list[str] = []
        for j, (indices, batch) in enumerate(zip(micro_indices, micro_batches, strict=True)):
            batch = _to_device(batch, self.engine.device)
            loss_sum, stats = self.compute_loss(self.engine.module, batch)
            self.engine.backward(loss_sum * (self.world_size / total_units))
            stats = {"loss": float(loss_sum.detach()), **stats}
            if not math.isfinite(stats["loss"]):
                not_finite.append(
                    f"loss {stats['loss']} in micro-batch {j} of rank {self.rank} ({self._describe(indices)})"
                )
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        step_info = self.engine.step(finite_loss=not not_finite)
        self.skipped.after_step(
            self.step + 1,
            bool(step_info["skipped"]),
            "; ".join(not_finite) or f"gradient norm {step_info['grad_norm']}",
        )
        keys = sorted(sums)
        reduced = all_reduce_scalars([sums[k] for k in keys], op="sum")
        elapsed = time.perf_counter() - start
        metrics = {k: v / total_units for k, v in zip(keys, reduced)}
        metrics.update(step_info)
        # The step's samples' own tokens: no row padding, each sample once whatever the layout.
        tokens = sum(self.train_samples[i].num_tokens for i in global_indices)
        metrics["tokens_per_s"] = tokens / elapsed
        metrics["step_time_s"] = elapsed
        (peak,) = all_reduce_scalars([float(peak_memory_bytes(self.engine.device))], op="max")
        metrics["peak_memory_gib"] = peak / (1 << 30)  # the rank that held the most
        metrics["skipped_steps"] = self.skipped.total
        return metrics

    def _describe(self, indices: list[int]) -> str:
        """Where training samples came from (file and rows, where the data knows them), for a diagnostic."""
        rows: dict[str, list[str]] = {}
        for i in indices:
            sample = self.train_samples[i]
            source, row = getattr(sample, "source", None), getattr(sample, "row", None)
            if source and row is not None:
                rows.setdefault(f"{source} rows", []).append(str(row))
            else:
                rows.setdefault("training samples", []).append(f"#{i}")
        return "; ".join(f"{where} {', '.join(numbers)}" for where, numbers in rows.items())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if not self.eval_samples:
            return {}
        self.engine.eval()
        mine = self.eval_samples[self.dp_rank :: self.dp_size]
        size = self.train_cfg.eval_batch_size
        # Sharded models need every rank in every forward pass: all ranks run as many batches as
        # rank 0 (which holds the most samples); a rank out of samples runs a stand-in and drops it.
        num_batches = math.ceil(math.ceil(len(self.eval_samples) / self.dp_size) / size)
        sums: dict[str, float] = {}
        units = 0.0
        for j in range(num_batches):
            chunk = mine[j * size : (j + 1) * size]
            batch = _to_device(self.collate(chunk or self.eval_samples[:1]), self.engine.device)
            loss_sum, stats = self.compute_loss(self.engine.module, batch)
            if not chunk:
                continue
            units += self.batch_units(batch)
            for key, value in {"loss": float(loss_sum), **stats}.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        keys = sorted(set(sums) | {"loss"})
        reduced = all_reduce_scalars([sums.get(k, 0.0) for k in keys] + [units], op="sum")
        total = max(reduced[-1], 1e-12)
        self.engine.train()
        return {k: v / total for k, v in zip(keys, reduced[:-1])}

    def evaluate_and_log(self) -> dict[str, float]:
        metrics = {f"eval/{k}": v for k, v in self.evaluate().items()}
        if metrics:
            self.metrics.log(metrics, self.step)
            if self.is_main:
                log.info("step %d eval: %s", self.step, format_metrics(metrics))
        return metrics

    def save_checkpoint(self) -> None:
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "skipped": self.skipped.state_dict()}
        path = save_step_checkpoint(
            self.engine, self.output_dir / "checkpoints", self.step, state, keep_last=self.train_cfg.keep_last
        )
        if self.is_main:
            log.info("saved checkpoint %s", path)

    def export(self) -> Path:
        target = self.output_dir / "final"
        self.engine.export_hf(target, self.tokenizer)
        if self.is_main:
            log.info("exported the final model to %s", target)
        barrier()
        return target


def _endless(sampler: ResumableSampler):
    """Global batches across epochs (iterating the sampler once yields the rest of one epoch)."""
    while True:
        yield from sampler


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def data_stats_dict(stats: Any) -> dict[str, float]:
    """The data layer's statistics, flat for logging; examples of skipped rows go to the log."""
    for example in stats.skip_examples:
        log.warning("skipped row: %s", example)
    return stats.as_dict()
