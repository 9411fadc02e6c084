"""``raylign kd``: token-level knowledge distillation from a frozen teacher."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raylign.config.base import Section
from raylign.config.data import DataConfig
from raylign.config.engine import EngineConfig
from raylign.config.model import ModelConfig
from raylign.config.offline import refuse_what_the_command_cannot_use
from raylign.config.optim import OptimConfig
from raylign.config.train import TrainConfig


class TeacherConfig(Section):
    """The frozen teacher; it must use the student's tokenizer (same vocabulary)."""

    path: str = Field(..., description="Local Hugging Face folder of the teacher (or 'smollm2-135m-instruct').")
    tokenizer_path: str | None = Field(
        None, description="Teacher tokenizer folder, compared with the student's; defaults to the teacher path."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Teacher parameter dtype; auto as for model.dtype."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="Teacher attention kernel.")
    trust_remote_code: bool = Field(False, description="Allow model code from the teacher folder.")


class KDSection(Section):
    """Which divergence between the teacher's and the student's next-token distributions is minimised."""

    loss: Literal["forward_kl", "reverse_kl", "generalized_jsd"] = Field(
        "forward_kl",
        description="forward_kl: KL(teacher || student), mode covering (Hinton et al. 2015); reverse_kl: "
        "KL(student || teacher), mode seeking (MiniLLM); generalized_jsd: JSD with weight beta (GKD).",
    )
    beta: float = Field(
        0.5, ge=0, le=1, description="generalized_jsd only: 0 gives forward KL, 1 reverse KL, 0.5 the symmetric JSD."
    )
    temperature: float = Field(
        1.0, gt=0, description="Both distributions are softmax(logits / temperature) in the divergence."
    )
    nll_coef: float = Field(
        0.0, ge=0, description="Weight of an added cross-entropy on the data's target tokens (0: pure distillation)."
    )


class KDConfig(Section):
    """raylign kd: distil a frozen teacher into the student on the target tokens of SFT-style data."""

    model: ModelConfig = Field(..., description="The student to train.")
    teacher: TeacherConfig = Field(..., description="The frozen teacher model.")
    data: DataConfig = Field(
        ..., description="SFT-style data (chat, prompt/output or plain text); divergences count on target tokens."
    )
    kd: KDSection = Field(default_factory=KDSection, description="Divergence, temperature and NLL mixing.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Training backend and parallelism.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and learning-rate schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Loop, batching, evaluation, checkpoints.")

    @model_validator(mode="after")
    def _layouts_it_can_train(self) -> KDConfig:
        refuse_what_the_command_cannot_use(self, "kd")
        return self
