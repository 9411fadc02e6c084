"""Process reward model: classify every solution step as correct or incorrect.

The model is the backbone's ``AutoModelForSequenceClassification`` with two labels
(0 = incorrect, 1 = correct), read as *token* scores: the head's logits at the step-separator
token that ends each step (:func:`raylign.models.token_scores`). Training minimises the
cross-entropy there (:func:`raylign.algorithms.process_reward_loss`, hard or soft labels);
the loss is the mean over all steps of the global batch, and ``step_accuracy`` is reported.

Saved model: ``<output_dir>/final`` is an ordinary sequence-classification folder (it loads
with ``AutoModelForSequenceClassification``; for a solution that ends with a separator its
pooled ``logits`` are the last step's).
The tokenizer there holds the separator token, and ``config.json`` records how solutions
were laid out (``prm_step_separator``, ``prm_prompt_format``, ``prm_prompt_template``), so
:func:`score_steps` scores new solutions exactly as the model was trained.

With ``engine.sequence_parallel_size`` n > 1 each micro-batch is packed into one row, cut into n
chunks with ring attention between them, and each rank scores the step separators its chunk holds:
its loss is the sum over them and its units their count, as in SFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from raylign.algorithms import process_reward_loss
from raylign.config.model import ModelConfig
from raylign.config.prm import PRMConfig
from raylign.data.prm import (
    add_step_separator,
    build_prm_datasets,
    collate_prm,
    encode_prm_prompt,
    encode_prm_sequence,
    single_token_id,
)
from raylign.models import load_score_model, load_tokenizer, token_scores
from raylign.models.packed_attention import ONE_ROW
from raylign.models.sequence_parallel import SequenceShard, chunk_of_row, sequence_shard, shard_packed_batch
from raylign.trainers.loop import Batch, OfflineTrainer, data_stats_dict

NUM_CLASSES = 2
CORRECT = 1
LABEL_NAMES = {0: "incorrect_step", 1: "correct_step"}


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model under an optional PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def fit_embeddings_to_tokenizer(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    added_ids: Sequence[int] = (),
    init_text: str = "\n",
    rows_multiple: int = 1,
) -> None:
    """Make room in the input embeddings for every token of the tokenizer, to a multiple of
    ``rows_multiple`` rows (the tensor-parallel size, which splits the rows evenly), and start the
    rows of ``added_ids`` (tokens added to the tokenizer for this run: the step separator) as a copy
    of the embedding of ``init_text`` (a newline, the usual step delimiter of plain-text solutions).

    A checkpoint may have spare rows already (Qwen2's 151,936 for 151,665 tokens): an added token
    then takes one of them, never trained, and needs the same start. Transformers' default for
    new rows is near the mean of all rows, which can have a far smaller norm than any real token's
    embedding: after the first RMSNorm its direction is then set by the first optimizer updates,
    and the scores read at the separator jump around early in training. (With LoRA the rows stay
    frozen.)
    """
    base = _hf_model(model)
    if base.get_input_embeddings().weight.shape[0] < len(tokenizer):
        base.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=rows_multiple, mean_resizing=False)
    added = set(added_ids)
    init_ids = [i for i in tokenizer.encode(init_text, add_special_tokens=False) if i not in added]
    if added and init_ids:
        weight = base.get_input_embeddings().weight
        with torch.no_grad():
            weight[sorted(added)] = weight[init_ids[-1]].clone()


def record_step_layout(model: nn.Module, separator: str, prompt_format: str, prompt_template: str) -> None:
    """Store how solutions are laid out in the model config, so the exported folder is self-describing."""
    config = _hf_model(model).config
    config.prm_step_separator = separator
    config.prm_prompt_format = prompt_format
    config.prm_prompt_template = prompt_template
    config.id2label = dict(LABEL_NAMES)
    config.label2id = {name: i for i, name in LABEL_NAMES.items()}


class PRMTrainer(OfflineTrainer):
    name = "prm"
    cfg: PRMConfig

    def build_tokenizer(self):
        m = self.cfg.model
        tokenizer = load_tokenizer(m.tokenizer_path or m.path, padding_side="right")
        before = len(tokenizer)
        self.separator_id = add_step_separator(tokenizer, self.cfg.prm.step_separator)
        self.added_ids = list(range(before, len(tokenizer)))
        return tokenizer

    def build_model(self) -> nn.Module:
        model = load_score_model(self.model_config(self.cfg.model), num_labels=NUM_CLASSES)
        fit_embeddings_to_tokenizer(
            model, self.tokenizer, self.added_ids, rows_multiple=self.cfg.engine.tensor_parallel_size
        )
        record_step_layout(model, self.cfg.prm.step_separator, self.cfg.data.format, self.cfg.data.prompt_template)
        return model

    def build_datasets(self) -> tuple[list, list, dict[str, Any]]:
        data = build_prm_datasets(self.cfg.data, self.cfg.prm, self.tokenizer, self.separator_id)
        return data.train, data.eval, {**data_stats_dict(data.stats), **data.step_stats()}

    def collate(self, samples: list) -> Batch:
        split = self.sp_size > 1  # then one row, which the group cuts into chunks
        batch = collate_prm(
            samples,
            self.tokenizer.pad_token_id,
            self.cfg.data.packing,
            soft_labels=self.cfg.prm.label_type == "soft",
            row_tokens=ONE_ROW if split else self.row_tokens,
        )
        if not split:
            return batch
        chunk = shard_packed_batch(batch, self.sp_rank, self.sp_size, self.tokenizer.pad_token_id)
        return {
            **{key: chunk[key] for key in ("input_ids", "position_ids", "token_index", "sample_ids")},
            **{key: chunk_of_row(batch[key], self.sp_rank, self.sp_size) for key in ("loss_mask", "step_labels")},
        }

    def batch_units(self, batch: Batch) -> float:
        return float(batch["loss_mask"].sum())  # steps

    def compute_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        if "token_index" in batch:  # this rank's chunk of a row shared by its sequence-parallel group
            shard = SequenceShard(self.sp_group, batch["token_index"], batch["sample_ids"], self.collective_timeout)
            with sequence_shard(shard):
                logits = token_scores(model, batch["input_ids"], position_ids=batch["position_ids"])
        else:
            logits = token_scores(model, batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"))
        loss, metrics = process_reward_loss(logits, batch["step_labels"], batch["loss_mask"])
        steps = self.batch_units(batch)
        return loss * steps, {"step_accuracy": float(metrics["step_accuracy"]) * steps}


def run_prm(cfg: PRMConfig) -> dict[str, float]:
    return PRMTrainer(cfg).run()


# ---- inference ------------------------------------------------------------------------------


def load_prm(path: str | Path, dtype: str = "float32", device: str | torch.device | None = None):
    """A trained PRM folder as ``(model in eval mode, tokenizer)``."""
    model = load_score_model(
        ModelConfig(path=str(path), dtype=dtype), num_labels=NUM_CLASSES, init_from_causal_lm=False, device=device
    )
    return model.eval(), load_tokenizer(path, padding_side="right")


@torch.no_grad()
def score_steps(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    steps: list[str],
    *,
    step_separator: str | None = None,
    prompt_format: str | None = None,
    prompt_template: str | None = None,
) -> list[float]:
    """Probability that each step is correct, in step order.

    The solution is laid out as in training: the prompt, then every step followed by the
    separator; the score of step k is ``softmax(logits at its separator)[correct]``. Layout
    settings default to those the trained model recorded in its config.
    """
    if not steps:
        return []
    config = _hf_model(model).config
    separator = step_separator or getattr(config, "prm_step_separator", None)
    prompt_format = prompt_format or getattr(config, "prm_prompt_format", "chat")
    prompt_template = prompt_template or getattr(config, "prm_prompt_template", "{input}\n")
    if separator is None:
        raise ValueError("the model config records no prm_step_separator; pass step_separator=")
    separator_id = single_token_id(tokenizer, separator)
    if separator_id is None:
        raise ValueError(f"the step separator {separator!r} is not a single token of this tokenizer")
    for i, step in enumerate(steps):
        if separator in step:
            raise ValueError(f"steps[{i}] contains the step separator {separator!r}")
    prompt_ids = encode_prm_prompt(tokenizer, prompt, prompt_format, prompt_template)
    ids, positions = encode_prm_sequence(tokenizer, prompt_ids, steps, separator_id)
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    logits = token_scores(model, input_ids, torch.ones_like(input_ids))
    return torch.softmax(logits[0, positions], dim=-1)[:, CORRECT].tolist()
