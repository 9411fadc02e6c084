"""Training-engine section: which backend and how it shards."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from raylign.config.base import Section


class EngineConfig(Section):
    backend: Literal["local", "fsdp2", "deepspeed"] = Field(
        "local", description="local: one process; fsdp2: torch fully_shard; deepspeed: ZeRO."
    )
    num_processes: int = Field(
        1, ge=1, description="Data-parallel ranks on this machine; the CLI starts them with torchrun when > 1."
    )
    zero_stage: Literal[1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage (deepspeed backend).")
    offload_optimizer: bool = Field(
        False,
        description="Keep optimizer state on the CPU. deepspeed: ZeRO-Offload with DeepSpeedCPUAdam (JIT-compiled "
        "once, cached under TORCH_EXTENSIONS_DIR; scripts/install.sh prebuilds it); fsdp2: CPUOffloadPolicy, which "
        "moves parameters too.",
    )
    offload_params: bool = Field(
        False, description="Keep parameters on the CPU between uses (fsdp2: CPUOffloadPolicy; deepspeed: ZeRO-3 only)."
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Dtype of gradient reduction across ranks (fsdp2 reduce-scatter; deepspeed communication "
        "dtype of bf16 models).",
    )
    dist_timeout_s: int = Field(1800, ge=10, description="torch.distributed collective timeout in seconds.")
