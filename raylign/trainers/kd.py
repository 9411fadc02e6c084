"""Knowledge distillation: match a frozen teacher's next-token distributions on SFT-style data.

Data, batching and units are SFT's (the target tokens of each sample); at every position
that predicts a target token the student minimises a divergence from the teacher
(``kd.loss``: forward KL, reverse KL or generalised JSD, from
:mod:`raylign.algorithms.distillation`), optionally plus ``kd.nll_coef`` times the
cross-entropy on the target token. The loss is the mean over all target tokens of the
global batch. Teacher and student must share the tokenizer: the vocabularies are compared
before anything is trained, and distributions are compared over the tokenizer's tokens (a
model's padded extra logits are left out). With fsdp2 on several ranks the teacher is sharded like
the student (:func:`raylign.engine.load_frozen`), else a whole copy on every rank. As in the GKD
paper, the divergence is not rescaled by ``temperature ** 2``.

With ``engine.sequence_parallel_size`` n > 1 the rows are cut as in SFT and the teacher, built with
ring attention too, runs on the same chunks: a rank's loss is the sum over the targets its chunk
predicts and its units their count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase

from raylign.algorithms import DISTILLATION_LOSSES
from raylign.config.kd import KDConfig, TeacherConfig
from raylign.config.model import ModelConfig
from raylign.engine import load_frozen
from raylign.models import attention_kwargs, load_tokenizer
from raylign.models.sequence_parallel import sharded_logits
from raylign.trainers.loop import Batch
from raylign.trainers.sft import SFTTrainer

MAX_LISTED_TOKENS = 5


def check_same_vocabulary(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> None:
    """Raise ValueError unless both tokenizers map the same token strings to the same ids."""
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab == teacher_vocab:
        return
    only_student = sorted(set(student_vocab) - set(teacher_vocab))[:MAX_LISTED_TOKENS]
    only_teacher = sorted(set(teacher_vocab) - set(student_vocab))[:MAX_LISTED_TOKENS]
    moved = sorted(t for t in set(student_vocab) & set(teacher_vocab) if student_vocab[t] != teacher_vocab[t])
    raise ValueError(
        "teacher and student tokenizers differ, so their distributions cannot be compared token by token: "
        f"student has {len(student_vocab)} tokens, teacher {len(teacher_vocab)}; only in the student: "
        f"{only_student}; only in the teacher: {only_teacher}; tokens with different ids: "
        f"{moved[:MAX_LISTED_TOKENS]} ({len(moved)} in all). Distil into a student built on the teacher's tokenizer."
    )


def teacher_model_config(teacher: TeacherConfig) -> ModelConfig:
    return ModelConfig(
        path=teacher.path,
        tokenizer_path=teacher.tokenizer_path,
        dtype=teacher.dtype,
        attn_implementation=teacher.attn_implementation,
        trust_remote_code=teacher.trust_remote_code,
    )


def _output_size(model: nn.Module) -> int:
    """Tokens the LM head predicts (from the config: sharded or partitioned weights hide the real shape)."""
    return int(model.config.get_text_config().vocab_size)


class KDTrainer(SFTTrainer):
    name = "kd"
    cfg: KDConfig

    def build_tokenizer(self):
        tokenizer = super().build_tokenizer()
        t = self.cfg.teacher
        check_same_vocabulary(tokenizer, load_tokenizer(t.tokenizer_path or t.path))
        return tokenizer

    def on_setup(self) -> None:
        teacher = self.model_config(teacher_model_config(self.cfg.teacher))
        self.teacher = load_frozen(teacher, self.cfg.engine, self.engine.device)
        self.vocab_size = len(self.tokenizer)
        for role, model in (("teacher", self.teacher), ("student", self.engine.hf_model)):
            if _output_size(model) < self.vocab_size:
                raise ValueError(
                    f"the {role} predicts {_output_size(model)} tokens but the tokenizer has {self.vocab_size}"
                )

    def compute_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        kd = self.cfg.kd
        student, targets = self._target_logits(model, batch)
        with torch.no_grad():
            teacher, _ = self._target_logits(self.teacher, batch)
        tokens = student.shape[0]
        options = {"temperature": kd.temperature, **({"beta": kd.beta} if kd.loss == "generalized_jsd" else {})}
        mask = torch.ones((1, tokens), dtype=torch.long, device=student.device)
        divergence, metrics = DISTILLATION_LOSSES.get(kd.loss)(student[None], teacher[None], mask, **options)
        loss_sum = divergence * tokens
        stats = {"divergence": float(metrics["divergence"]) * tokens}
        if kd.nll_coef:
            nll = F.cross_entropy(student, targets, reduction="sum")
            loss_sum = loss_sum + kd.nll_coef * nll
            stats["nll"] = float(nll.detach())
        return loss_sum, stats

    def _target_logits(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 logits ``[N, vocabulary]`` at the N positions that predict a target token, and those
        targets ``[N]``: logits at t predict token t + 1."""
        if "target_mask" in batch:  # this rank's chunk of a row shared by its sequence-parallel group
            predicts_target = batch["target_mask"].bool()
            logits = sharded_logits(model, batch, self.sp_group, self.collective_timeout)[predicts_target]
            targets = batch["target_ids"][predicts_target]
        else:
            inputs = {
                "input_ids": batch["input_ids"],
                **attention_kwargs(batch.get("attention_mask"), batch.get("position_ids")),
            }
            predicts_target = batch["loss_mask"][:, 1:].bool()
            logits = model(**inputs).logits[:, :-1][predicts_target]
            targets = batch["input_ids"][:, 1:][predicts_target]
        return logits[:, : self.vocab_size].float(), targets


def run_kd(cfg: KDConfig) -> dict[str, float]:
    return KDTrainer(cfg).run()
