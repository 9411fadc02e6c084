"""One typed config per command, composed from the sections."""

from __future__ import annotations

from pydantic import Field, model_validator

from raylign.config.base import Section
from raylign.config.data import DataConfig
from raylign.config.engine import EngineConfig
from raylign.config.model import ModelConfig
from raylign.config.offline import refuse_what_the_command_cannot_use
from raylign.config.optim import OptimConfig
from raylign.config.train import TrainConfig


class SFTConfig(Section):
    """raylign sft: supervised fine-tuning (chat, prompt/output or pretraining-style data)."""

    model: ModelConfig = Field(..., description="The model to fine-tune.")
    data: DataConfig = Field(..., description="Training and evaluation data.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Training backend and parallelism.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and learning-rate schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Loop, batching, evaluation, checkpoints.")

    @model_validator(mode="after")
    def _layouts_it_can_train(self) -> SFTConfig:
        refuse_what_the_command_cannot_use(self, "sft")
        return self
