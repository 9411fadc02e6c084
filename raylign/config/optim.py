"""Optimizer and learning-rate schedule section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from raylign.config.base import Section


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0, description="Peak learning rate of AdamW.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (not applied to biases and norms).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    scheduler: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warmup: cosine or linear to min_lr_ratio * lr, or constant."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup length in optimizer steps.")
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Where cosine or linear decay ends, as a fraction of lr. The decay reaches it at the step after "
        "the last (as Hugging Face's schedules do), so the last step still trains a little above it: over 7 steps "
        "with ratio 0.1 and no warm-up, cosine's last step uses 0.145 * lr.",
    )
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables.")
    master_weights: bool = Field(
        True,
        description="A bf16 model is updated through fp32 master copies of its weights. false: the optimizer "
        "updates the bf16 weights themselves (fp32 arithmetic and moments, the result rounded stochastically so "
        "that updates below bf16's resolution survive on average): 6 bytes less per parameter (no fp32 weight "
        "and gradient copies) for noisier weights and bf16 gradient accumulation. local and fsdp2 engines only.",
    )
