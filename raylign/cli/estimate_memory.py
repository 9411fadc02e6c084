"""``raylign estimate-memory``: memory per rank of a training run, from the model's shape and the layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from raylign.config.base import Section
from raylign.config.engine import EngineConfig, refuse_master_weights_off
from raylign.engine.memory import (
    KNOWN_SHAPES,
    Layout,
    ModelShape,
    estimate_training_memory,
    format_bytes,
    parameter_count,
)

# The layouts of the documentation's table: (name, Layout fields).
TABLE_LAYOUTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("local, 1 rank", {"backend": "local", "ranks": 1}),
    ("fsdp2, 8 ranks", {"backend": "fsdp2", "ranks": 8}),
    ("fsdp2, 8 ranks, checkpointing", {"backend": "fsdp2", "ranks": 8, "gradient_checkpointing": True}),
    (
        "fsdp2 2 x TP 4, checkpointing",
        {"backend": "fsdp2", "ranks": 8, "tensor_parallel": 4, "gradient_checkpointing": True},
    ),
    ("ZeRO-2, 8 ranks", {"backend": "deepspeed", "zero_stage": 2, "ranks": 8}),
    (
        "ZeRO-3, 8 ranks, optimizer offload",
        {"backend": "deepspeed", "zero_stage": 3, "ranks": 8, "offload_optimizer": True},
    ),
)


class EstimateMemoryConfig(Section):
    """raylign estimate-memory: device memory per rank of training a model (AdamW) with a backend and a
    parallel layout, by what holds it; see raylign/engine/memory.py for what is counted."""

    model: str = Field(
        "7b",
        description="A model folder (its config.json), 'smollm2-135m-instruct', or one of the sizes "
        f"{', '.join(KNOWN_SHAPES)} (the Qwen2.5 shapes).",
    )
    dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="The model's dtype.")
    backend: Literal["local", "fsdp2", "deepspeed"] = Field("fsdp2", description="As engine.backend.")
    zero_stage: Literal[1, 2, 3] = Field(2, description="As engine.zero_stage (deepspeed).")
    num_processes: int = Field(8, ge=1, description="Ranks in all (data x tensor x sequence parallel).")
    tensor_parallel_size: int = Field(1, ge=1, description="As engine.tensor_parallel_size.")
    sequence_parallel_size: int = Field(1, ge=1, description="As engine.sequence_parallel_size.")
    micro_batch_tokens: int = Field(4096, ge=1, description="Tokens in one rank's micro-batch.")
    gradient_checkpointing: bool = Field(False, description="As model.gradient_checkpointing.")
    master_weights: bool = Field(True, description="As optim.master_weights (bf16 models).")
    offload_params: bool = Field(False, description="As engine.offload_params.")
    offload_optimizer: bool = Field(False, description="As engine.offload_optimizer.")
    reshard_after_forward: bool = Field(True, description="As engine.reshard_after_forward (fsdp2).")
    tensor_parallel_shard_activations: bool = Field(
        True, description="As engine.tensor_parallel_shard_activations (fsdp2)."
    )
    table: bool = Field(
        False,
        description="Print instead the documentation's table: the sizes 0.5b-32b (bf16, 4096-token micro-batches) "
        "under six layouts.",
    )

    @model_validator(mode="after")
    def _a_layout_training_accepts(self) -> EstimateMemoryConfig:
        """The layout checks of a training run's config (the error names engine's field), so that no
        figure is printed for a layout training would refuse."""
        engine = EngineConfig(
            backend=self.backend,
            zero_stage=self.zero_stage,
            num_processes=self.num_processes,
            tensor_parallel_size=self.tensor_parallel_size,
            sequence_parallel_size=self.sequence_parallel_size,
            offload_params=self.offload_params,
            offload_optimizer=self.offload_optimizer,
        )
        refuse_master_weights_off(engine, self, field="master_weights")
        return self


def model_shape(name: str) -> ModelShape:
    if name.lower() in KNOWN_SHAPES:
        return KNOWN_SHAPES[name.lower()]
    from transformers import AutoConfig

    from raylign.models import resolve_model_path

    return ModelShape.from_config(
        AutoConfig.from_pretrained(str(resolve_model_path(Path(name) if "/" in name else name)))
    )


def run_estimate_memory(cfg: EstimateMemoryConfig) -> dict[str, float]:
    if cfg.table:
        print(memory_table())
        return {}
    shape = model_shape(cfg.model)
    # fsdp2 offloads through one CPUOffloadPolicy, whichever flag asks (raylign.engine.fsdp2.offload_policy):
    # weights, gradients and optimizer state leave the device together.
    fsdp2_offload = cfg.backend == "fsdp2" and (cfg.offload_params or cfg.offload_optimizer)
    layout = Layout(
        dtype=cfg.dtype,
        backend=cfg.backend,
        zero_stage=cfg.zero_stage,
        ranks=cfg.num_processes,
        tensor_parallel=cfg.tensor_parallel_size,
        sequence_parallel=cfg.sequence_parallel_size,
        micro_batch_tokens=cfg.micro_batch_tokens,
        gradient_checkpointing=cfg.gradient_checkpointing,
        master_weights=cfg.master_weights,
        offload_params=cfg.offload_params or fsdp2_offload,
        offload_optimizer=cfg.offload_optimizer or fsdp2_offload,
        reshard_after_forward=cfg.reshard_after_forward,
        shard_activations=cfg.tensor_parallel_shard_activations,
    )
    estimate = estimate_training_memory(shape, layout)
    print(f"{cfg.model}: {parameter_count(shape)} parameters, {cfg.dtype}, {cfg.backend}, {cfg.num_processes} rank(s)")
    for name, value in estimate.device.items():
        print(f"  {name:<16s} {format_bytes(value):>11s}")
    print(f"  {'total':<16s} {format_bytes(estimate.total):>11s} per rank on the device")
    for name, value in estimate.host.items():
        print(f"  {name:<16s} {format_bytes(value):>11s} in host memory (offloaded)")
    return {**estimate.device, "total": estimate.total}


def memory_table() -> str:
    """Markdown: GiB per rank for every known size under every layout of :data:`TABLE_LAYOUTS`."""
    header = "| layout | " + " | ".join(f"{name} ({parameter_count(s)})" for name, s in KNOWN_SHAPES.items()) + " |"
    lines = [header, "|---" * (len(KNOWN_SHAPES) + 1) + "|"]
    for label, fields in TABLE_LAYOUTS:
        cells = []
        for shape in KNOWN_SHAPES.values():
            total = estimate_training_memory(shape, Layout(**fields)).total
            cells.append(f"{total / (1 << 30):.1f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
