"""``raylign rm``: reward-model training on preference pairs."""

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


class RewardLossConfig(Section):
    """Which pairwise loss trains the reward model, and its options."""

    loss: Literal["bradley_terry", "log_exp"] = Field(
        "bradley_terry",
        description="bradley_terry: -log sigma(r_chosen - r_rejected - margin); log_exp: the same loss written "
        "as log(1 + exp(r_rejected - r_chosen + margin)).",
    )
    margin_key: str | None = Field(
        None,
        min_length=1,
        description="Row key of a per-pair margin m (a number; e.g. how much better the chosen response was rated) "
        "subtracted inside the loss, as in Llama 2; every row must then have it. None: no margin.",
    )
    center_coef: float = Field(
        0.0,
        ge=0,
        description="bradley_terry only: adds center_coef * mean((r_chosen + r_rejected)^2) to keep rewards "
        "centred at 0.",
    )

    @model_validator(mode="after")
    def _center_needs_bradley_terry(self) -> RewardLossConfig:
        if self.center_coef and self.loss != "bradley_terry":
            raise ValueError(f"center_coef applies to loss 'bradley_terry' only (loss is {self.loss!r})")
        return self


class RMConfig(Section):
    """raylign rm: train a reward model (a one-output score head on the LM) on preference pairs.

    The final model is a Hugging Face AutoModelForSequenceClassification folder whose config.json
    also holds raylign_reward_mean and raylign_reward_std, the mean and standard deviation of its
    scores over the training pairs (both sides), for normalising rewards during RL.
    """

    model: ModelConfig = Field(..., description="The backbone; a fresh score head is added to a causal LM.")
    data: DataConfig = Field(
        ...,
        description="Preference pairs: rows with prompt, chosen and rejected (keys set per dataset). data.loss "
        "does not apply.",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Training backend and parallelism.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and learning-rate schedule.")
    train: TrainConfig = Field(
        default_factory=TrainConfig,
        description="Loop, batching (batch sizes count pairs), evaluation, checkpoints.",
    )
    rm: RewardLossConfig = Field(default_factory=RewardLossConfig, description="The reward-model loss.")

    @model_validator(mode="after")
    def _pairs_have_no_loss_mode(self) -> RMConfig:
        refuse_what_the_command_cannot_use(self, "rm")
        if self.data.loss != "prompt_masked":
            raise ValueError("data.loss applies to sft only; a reward model scores whole pairs")
        return self
