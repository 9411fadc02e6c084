"""The offline training loop's section, shared by SFT, RM, PRM, DPO, KTO and KD."""

from __future__ import annotations

from pydantic import Field, model_validator

from raylign.config.base import Section


class LoggingConfig(Section):
    tensorboard: bool = Field(True, description="Write TensorBoard event files under <output_dir>/tensorboard.")
    wandb: bool = Field(False, description="Also log to Weights & Biases (needs the wandb extra).")
    wandb_project: str = Field("raylign", description="wandb project name.")
    run_name: str | None = Field(None, description="Run name for wandb; defaults to the output folder's name.")
    progress_bar: bool = Field(True, description="Show a progress bar on the console.")


class TrainConfig(Section):
    output_dir: str = Field("outputs/run", description="Where checkpoints, logs, metrics and the final model go.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training set (ignored when max_steps > 0).")
    max_steps: int = Field(0, ge=0, description="Optimizer steps to run; 0 derives it from epochs.")
    global_batch_size: int = Field(32, ge=1, description="Samples per optimizer step, summed over all ranks.")
    micro_batch_size: int = Field(
        8,
        ge=1,
        description="Samples per forward pass on one rank (gradient accumulation "
        "steps = global_batch_size / (micro_batch_size * ranks)).",
    )
    eval_every: int = Field(0, ge=0, description="Evaluate every N optimizer steps and at the end; 0 only at the end.")
    eval_batch_size: int = Field(16, ge=1, description="Samples per forward pass during evaluation.")
    save_every: int = Field(0, ge=0, description="Checkpoint every N optimizer steps; 0 saves only at the end.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints to keep; older ones are deleted.")
    resume: bool = Field(
        True,
        description="Continue from the newest complete checkpoint in output_dir if there is one; false starts "
        "over, and this run's saves replace the checkpoints already there.",
    )
    export: bool = Field(True, description="Export the final model as a plain Hugging Face folder <output_dir>/final.")
    log_every: int = Field(1, ge=1, description="Log training metrics every N optimizer steps.")
    max_skipped_steps: int = Field(
        3,
        ge=0,
        description="Optimizer steps in a row that may be skipped for a non-finite "
        "loss or gradient norm (counted in skipped_steps) before the run stops with a "
        "diagnostic; 0 stops at the first.",
    )
    seed: int = Field(
        42,
        description="Seed of torch's random state: new weights (a reward model's score head, LoRA adapters) and "
        "dropout. The data order is seeded by data.seed.",
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metric sinks and console output.")

    @model_validator(mode="after")
    def _micro_divides_global(self) -> TrainConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size ({self.micro_batch_size})"
            )
        return self
