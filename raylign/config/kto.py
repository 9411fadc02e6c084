"""``raylign kto``: Kahneman-Tversky optimisation on unpaired desirable / undesirable examples."""

from __future__ import annotations

from pydantic import Field, model_validator

from raylign.config.base import Section
from raylign.config.data import DataConfig
from raylign.config.engine import EngineConfig
from raylign.config.model import ModelConfig
from raylign.config.offline import refuse_what_the_command_cannot_use
from raylign.config.optim import OptimConfig
from raylign.config.train import TrainConfig


class KTOSection(Section):
    """The KTO objective (Ethayarajh et al. 2024) and its reference model."""

    beta: float = Field(0.1, gt=0, description="Scale of the implied reward beta * log(pi / pi_ref).")
    desirable_weight: float = Field(1.0, gt=0, description="lambda_D, weight of the loss on desirable examples.")
    undesirable_weight: float = Field(
        1.0,
        gt=0,
        description="lambda_U, weight of the loss on undesirable examples. The KTO paper advises "
        "lambda_D * n_desirable / (lambda_U * n_undesirable) in [1, 4/3].",
    )
    estimate_kl: bool = Field(
        True,
        description="Estimate the reference point z0 = KL(pi || pi_ref) on mismatched pairs of each micro-batch "
        "(prompt i with completion i-1); off: z0 = 0. Needs train.micro_batch_size >= 2.",
    )
    reference_path: str | None = Field(
        None,
        description="Frozen reference model folder; defaults to model.path (the policy's starting weights), "
        "or for a LoRA policy the policy itself with its adapters off.",
    )


class KTOConfig(Section):
    """raylign kto: KTO on unpaired rows {prompt, completion, label: true (desirable) | false (undesirable)}."""

    model: ModelConfig = Field(..., description="The policy to train.")
    data: DataConfig = Field(
        ...,
        description="Training and evaluation data. data.input_key, data.output_key and data.label_key name the "
        "prompt, completion and boolean label of a row.",
    )
    kto: KTOSection = Field(default_factory=KTOSection, description="KTO loss settings and the reference model.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Training backend and parallelism.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and learning-rate schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Loop, batching, evaluation, checkpoints.")

    @model_validator(mode="after")
    def _consistent(self) -> KTOConfig:
        refuse_what_the_command_cannot_use(self, "kto")
        if self.data.loss == "full":
            raise ValueError("data.loss 'full' does not apply to KTO (it scores the completion given the prompt)")
        if self.kto.estimate_kl and self.train.micro_batch_size < 2:
            raise ValueError(
                "kto.estimate_kl pairs prompts with other examples' completions inside a micro-batch: "
                f"train.micro_batch_size must be >= 2 (got {self.train.micro_batch_size}), or set "
                "kto.estimate_kl false"
            )
        return self
