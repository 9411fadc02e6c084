"""``raylign dpo``: direct preference optimisation and its family."""

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

PreferenceLoss = Literal["dpo", "cdpo", "ipo", "dpo_nll", "simpo", "orpo"]

# The options each loss reads; any other option set for it is a config error.
LOSS_OPTIONS: dict[str, tuple[str, ...]] = {
    "dpo": ("beta", "label_smoothing"),
    "cdpo": ("beta", "label_smoothing"),
    "ipo": ("beta",),
    "dpo_nll": ("beta", "nll_coef"),
    "simpo": ("beta", "label_smoothing", "simpo_gamma"),
    "orpo": ("orpo_lambda",),
}
# Losses without a reference model (must match the 'uses_reference' flag of the loss registry).
REFERENCE_FREE_LOSSES = ("simpo", "orpo")


class PreferenceLossConfig(Section):
    """Which preference loss, its coefficients and the reference model. Unset coefficients take the
    loss's own default (the value of its paper)."""

    loss: PreferenceLoss = Field(
        "dpo",
        description="dpo (Rafailov 2023), cdpo (conservative DPO: DPO with label smoothing, default 0.1), ipo "
        "(Azar 2023, on per-token average log-ratios), dpo_nll (DPO + NLL on the chosen response, Pang 2024), "
        "simpo (Meng 2024, reference-free), orpo (Hong 2024, reference-free odds-ratio + NLL).",
    )
    beta: float | None = Field(
        None,
        gt=0,
        description="Inverse temperature of the implicit reward (dpo, cdpo, dpo_nll: default 0.1; ipo: the "
        "paper's tau, default 0.1; simpo: default 2.0).",
    )
    label_smoothing: float | None = Field(
        None,
        ge=0,
        lt=0.5,
        description="Assumed probability that a label is flipped (dpo: default 0; cdpo: default 0.1; simpo: "
        "default 0).",
    )
    simpo_gamma: float | None = Field(None, description="simpo: target reward margin gamma (default 0.5).")
    nll_coef: float | None = Field(
        None, ge=0, description="dpo_nll: weight of the chosen response's per-token NLL (default 1.0)."
    )
    orpo_lambda: float | None = Field(
        None, ge=0, description="orpo: weight lambda of the odds-ratio term next to the NLL (default 0.1)."
    )
    reference_path: str | None = Field(
        None,
        description="Frozen reference model folder for losses that use one; None: the starting model (model.path), "
        "or for a LoRA policy the policy itself with its adapters off.",
    )
    precompute_reference: bool = Field(
        False,
        description="Compute the reference log-probs of every pair once before training (each rank its share, "
        "then shared) and free the reference model, instead of keeping it for a forward pass every step.",
    )

    @model_validator(mode="after")
    def _options_apply_to_the_loss(self) -> PreferenceLossConfig:
        allowed = LOSS_OPTIONS[self.loss]
        for name in ("beta", "label_smoothing", "simpo_gamma", "nll_coef", "orpo_lambda"):
            if getattr(self, name) is not None and name not in allowed:
                raise ValueError(f"{name} does not apply to loss {self.loss!r} (its options: {', '.join(allowed)})")
        if self.loss in REFERENCE_FREE_LOSSES:
            for name in ("reference_path", "precompute_reference"):
                if getattr(self, name):
                    raise ValueError(f"{name} does not apply to loss {self.loss!r}, which uses no reference model")
        return self


class DPOConfig(Section):
    """raylign dpo: train a causal LM on preference pairs with DPO, cDPO, IPO, DPO+NLL, SimPO or ORPO."""

    model: ModelConfig = Field(..., description="The policy to train (and, by default, the reference).")
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
    dpo: PreferenceLossConfig = Field(
        default_factory=PreferenceLossConfig, description="The preference loss and the reference model."
    )

    @model_validator(mode="after")
    def _pairs_have_no_loss_mode(self) -> DPOConfig:
        refuse_what_the_command_cannot_use(self, "dpo")
        if self.data.loss != "prompt_masked":
            raise ValueError("data.loss applies to sft only; preference losses score the responses")
        return self
