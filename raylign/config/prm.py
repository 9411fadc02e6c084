"""``raylign prm``: process reward model on step-labelled solutions."""

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


class PRMSection(Section):
    """How step-labelled rows look and how steps are marked in the token sequence."""

    step_separator: str = Field(
        "<|step|>",
        min_length=1,
        description="Token appended after every step; the model is scored at these positions. A string that is "
        "not one token of the tokenizer is added to it as a special token (embeddings resized). Steps must not "
        "contain it.",
    )
    steps_key: str = Field("steps", min_length=1, description="Key of a row's list of solution steps (strings).")
    labels_key: str = Field(
        "labels", min_length=1, description="Key of a row's list of step labels, one per step, in step order."
    )
    label_type: Literal["hard", "soft"] = Field(
        "hard",
        description="hard: each label is true/false, 1/0 or '+'/'-' (correct/incorrect); soft: a probability in "
        "[0, 1] that the step is correct (true/false and '+'/'-' count as 1/0).",
    )


class PRMConfig(Section):
    """raylign prm: train a process reward model that scores every step of a solution.

    Rows: {prompt, steps: [str], labels: [label per step]}. The model is a sequence-classification
    model with two labels (0 = incorrect step, 1 = correct step) read at every step separator;
    the final folder reloads with AutoModelForSequenceClassification and
    raylign.trainers.prm.load_prm, and raylign.trainers.prm.score_steps scores new solutions.
    """

    model: ModelConfig = Field(..., description="The backbone to train (a causal LM or a saved PRM).")
    data: DataConfig = Field(
        ...,
        description="Training and evaluation data. data.input_key names the prompt; data.format 'chat' renders "
        "the prompt as a user turn, 'plain' with prompt_template; steps follow the prompt as raw text.",
    )
    prm: PRMSection = Field(default_factory=PRMSection, description="Step separator, row keys and label kind.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Training backend and parallelism.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and learning-rate schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Loop, batching, evaluation, checkpoints.")

    @model_validator(mode="after")
    def _step_targets_only(self) -> PRMConfig:
        refuse_what_the_command_cannot_use(self, "prm")
        if self.data.loss == "full":
            raise ValueError("data.loss 'full' does not apply to a process reward model (it trains on step labels)")
        return self
