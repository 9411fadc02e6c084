"""Training-engine section: which backend and how it shards."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

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
    load_sharded: bool = Field(
        True,
        description="fsdp2: build the model on the meta device, shard it, then read each rank's rows of every "
        "weight from the model's safetensors files, so no rank ever holds the whole model; false loads the whole "
        "model on every rank first. LoRA adapters, which the files lack, are drawn on every rank as PEFT draws them; a "
        "4-bit base (model.lora.quantize_base) always loads whole.",
    )
    reshard_after_forward: bool = Field(
        True,
        description="fsdp2: each decoder layer gives its gathered weights back after its forward and gathers them "
        "again for the backward (least memory: one layer whole at a time); false keeps every layer's weights "
        "whole from its forward to its backward, which saves one all-gather per layer per micro-batch and holds "
        "the whole model's weights in compute precision on every rank meanwhile (ZeRO-2-like).",
    )
    tensor_parallel_shard_activations: bool = Field(
        True,
        description="fsdp2 with tensor_parallel_size T > 1: the activations between the split matrices (the "
        "residual stream, the norms) are split along the sequence over the T ranks too, so each keeps 1/T of "
        "them (Megatron-LM's sequence parallelism); the same bytes move between the ranks. false keeps them "
        "whole on every rank of the group.",
    )
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks that share one packed row, each running a contiguous chunk of it, with ring attention "
        "across them (attention never crosses packed samples). Data-parallel ranks = ranks / (this x "
        "tensor_parallel_size). Every offline command (with data.packing; engine.backend fsdp2 or deepspeed) "
        "and rl (the policy and critic); with tensor_parallel_size T > 1 too (a 3-D layout, each rank of a row's "
        "group running its chunk split over T ranks: fsdp2's plan or deepspeed's AutoTP); 1 turns it off.",
    )

    sequence_parallel_mode: Literal["ring", "ulysses"] = Field(
        "ring",
        description="How the ranks sharing a row (sequence_parallel_size > 1) attend over each other's chunks. "
        "ring: keys and values pass around the ranks in n - 1 hops (any number of heads; each rank holds one "
        "chunk's scores against another at a time). ulysses: DeepSpeed-Ulysses, two all-to-alls per layer give "
        "each rank the whole row of 1/n of the heads (the attention heads, per tensor-parallel rank, must "
        "divide by sequence_parallel_size; each rank holds the whole row's scores for its heads).",
    )

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks that split every attention and MLP matrix of the model between them (tensor "
        "parallel, the transformers tensor-parallel plan of the architecture: Llama, Qwen2/Qwen3, Mistral, ...), "
        "each computing its share of every layer on the same micro-batch; composed with fsdp2 as a 2-D mesh "
        "(data-parallel ranks = ranks / this, each sharding its weights over those), or with deepspeed as "
        "DeepSpeed AutoTP (ZeRO stage 1 or 2 over the data-parallel ranks). Every offline command (sft, rm, prm, "
        "dpo, kto, kd; their frozen models are sharded, not split) and rl's policy and critic "
        "(placement.policy_workers / critic_workers are the ranks); 1 turns it off.",
    )

    data_parallel_shard_size: int | None = Field(
        None,
        ge=1,
        description="fsdp2: data-parallel ranks each weight is sharded over; the groups of that many ranks then "
        "replicate one another (hybrid sharding, HSDP: all-gathers stay within a group, only gradients are "
        "reduced across groups). Must divide the data-parallel ranks (ranks / tensor_parallel_size). None: shard "
        "over all of them.",
    )

    @model_validator(mode="after")
    def _no_setting_the_backend_ignores(self) -> EngineConfig:
        """A setting only other backends read, given a value, would do nothing: refused naming both."""
        read_by = {
            "zero_stage": ("deepspeed",),
            "offload_optimizer": ("fsdp2", "deepspeed"),
            "offload_params": ("fsdp2", "deepspeed"),
            "reduce_dtype": ("fsdp2", "deepspeed"),  # one process reduces nothing
            "load_sharded": ("fsdp2",),
            "reshard_after_forward": ("fsdp2",),
            "tensor_parallel_shard_activations": ("fsdp2",),
        }
        for field in self.set_away_from_default([f for f, backends in read_by.items() if self.backend not in backends]):
            raise ValueError(
                f"engine.{field} {getattr(self, field)} is read by engine.backend {' or '.join(read_by[field])} only; "
                f"with {self.backend!r} it would do nothing: leave it unset, or choose that backend"
            )
        return self

    @model_validator(mode="after")
    def _parameters_offload_under_zero3(self) -> EngineConfig:
        if self.backend == "deepspeed" and self.offload_params and self.zero_stage != 3:
            raise ValueError(
                f"engine.offload_params needs engine.zero_stage 3 with engine.backend deepspeed (got "
                f"{self.zero_stage}): only ZeRO-3 partitions parameters"
            )
        return self

    @model_validator(mode="after")
    def _processes_need_a_distributed_backend(self) -> EngineConfig:
        if self.backend == "local" and self.num_processes > 1:  # caught here, before torchrun starts the ranks
            raise ValueError(
                f"engine.num_processes {self.num_processes} needs engine.backend 'fsdp2' or 'deepspeed': "
                "'local' runs in one process"
            )
        return self

    @model_validator(mode="after")
    def _tensor_parallel(self) -> EngineConfig:
        tp = self.tensor_parallel_size
        if tp == 1:
            return self
        if self.backend == "local":
            raise ValueError(
                f"engine.tensor_parallel_size {tp} needs engine.backend 'fsdp2' or 'deepspeed' (got 'local')"
            )
        if self.backend == "deepspeed" and self.zero_stage == 3:
            raise ValueError(
                f"engine.tensor_parallel_size {tp} with engine.backend deepspeed (AutoTP) needs engine.zero_stage "
                "1 or 2 (got 3: DeepSpeed does not combine AutoTP with partitioned parameters)"
            )
        if self.num_processes > 1 and self.num_processes % tp:  # 1: an outer launcher starts the ranks
            raise ValueError(
                f"engine.tensor_parallel_size ({tp}) must divide engine.num_processes ({self.num_processes})"
            )
        sp = self.sequence_parallel_size
        if sp > 1 and self.num_processes > 1 and self.num_processes % (tp * sp):
            raise ValueError(
                f"engine.tensor_parallel_size x engine.sequence_parallel_size ({tp} x {sp}) must divide "
                f"engine.num_processes ({self.num_processes})"
            )
        return self

    @model_validator(mode="after")
    def _hybrid_sharding(self) -> EngineConfig:
        size = self.data_parallel_shard_size
        if size is None:
            return self
        if self.backend != "fsdp2":
            raise ValueError(f"engine.data_parallel_shard_size needs engine.backend 'fsdp2' (got {self.backend!r})")
        data_parallel = self.num_processes // self.tensor_parallel_size
        if self.num_processes > 1 and data_parallel % size:
            raise ValueError(
                f"engine.data_parallel_shard_size ({size}) must divide the data-parallel ranks (engine.num_processes "
                f"/ engine.tensor_parallel_size = {data_parallel})"
            )
        return self

    @model_validator(mode="after")
    def _sequence_parallel_backend(self) -> EngineConfig:
        if self.sequence_parallel_size > 1 and self.backend not in ("fsdp2", "deepspeed"):
            raise ValueError(
                f"engine.sequence_parallel_size {self.sequence_parallel_size} needs engine.backend 'fsdp2' or "
                f"'deepspeed' (got {self.backend!r})"
            )
        if self.num_processes > 1 and self.num_processes % self.sequence_parallel_size:
            raise ValueError(
                f"engine.sequence_parallel_size ({self.sequence_parallel_size}) must divide "
                f"engine.num_processes ({self.num_processes})"
            )
        return self


LORA_AUTOTP = (
    "engine.tensor_parallel_size > 1 with engine.backend deepspeed (AutoTP) does not support model.lora: AutoTP "
    "splits the linear layers the adapters wrap; use engine.backend fsdp2, whose plan splits the adapters with them"
)
SPLITS_ROWS = {"sft", "rm", "prm", "dpo", "kto", "kd"}  # offline commands whose rows sequence parallelism splits


def refuse_master_weights_off(engine: EngineConfig, optim: Any, field: str = "optim.master_weights") -> None:
    """``optim.master_weights: false`` where the backend keeps fp32 masters whatever it says."""
    if engine.backend == "deepspeed" and not optim.master_weights:
        raise ValueError(
            f"{field}: false needs engine.backend 'local' or 'fsdp2': DeepSpeed's bf16 mode always "
            "keeps fp32 master partitions"
        )


def refuse_unsupported_layouts(engine: EngineConfig, model: Any, command: str, packing: bool = True) -> None:
    """What an offline command cannot train yet, refused by name before anything starts:

    * sequence parallelism in a command whose training path does not split rows across ranks (every
      offline command's does today), or with unpacked data (it splits packed rows);
    * LoRA under DeepSpeed AutoTP (fsdp2's plan splits the adapters with the layers they wrap);
    * a 4-bit base (``model.lora.quantize_base``) where :func:`refuse_quantized_layout` says; and for
      prm at all, whose grown embedding has no full-precision original to merge the export into.
    """
    if engine.sequence_parallel_size > 1:
        if command not in SPLITS_ROWS:
            raise ValueError(
                f"engine.sequence_parallel_size: {command} does not support sequence parallelism yet "
                f"({', '.join(sorted(SPLITS_ROWS))} and rl do); set it to 1 (got {engine.sequence_parallel_size})"
            )
        if not packing:
            raise ValueError("engine.sequence_parallel_size > 1 splits packed rows: data.packing must be true")
    if engine.tensor_parallel_size > 1 and engine.backend == "deepspeed" and model.lora.rank > 0:
        raise ValueError(LORA_AUTOTP)
    if model.lora.quantize_base == "none":
        return
    if command == "prm":
        raise ValueError(
            f"model.lora.quantize_base {model.lora.quantize_base!r}: prm grows the embedding by its step "
            "separator, which a 4-bit base's export cannot merge into; use model.lora with quantize_base: none"
        )
    refuse_quantized_layout(engine, model, command)


def refuse_quantized_layout(engine: EngineConfig, model: Any, command: str) -> None:
    """A 4-bit base (``model.lora.quantize_base``) trains on one process (local), on fsdp2 ranks that
    each hold the packed base whole and shard the rest, or on deepspeed ranks under ZeRO-1/2, which
    partition the adapters' optimizer state only (data parallel, sequence parallel too); not under
    ZeRO-3, which would partition bitsandbytes' packed weights and their quantisation state, nor split
    by tensor parallel."""
    quantize = model.lora.quantize_base
    if quantize == "none":
        return
    if engine.backend == "deepspeed" and engine.zero_stage == 3:
        raise ValueError(
            f"model.lora.quantize_base {quantize!r}: {command} trains a 4-bit base with engine.backend local, "
            "fsdp2, or deepspeed with engine.zero_stage 1 or 2 (each rank holding the 4-bit base whole); got "
            "zero_stage 3, which would partition bitsandbytes' packed weights"
        )
    if engine.tensor_parallel_size > 1:
        raise ValueError(
            f"model.lora.quantize_base {quantize!r}: {command} does not split a 4-bit base's matrices yet; set "
            f"engine.tensor_parallel_size to 1 (got {engine.tensor_parallel_size})"
        )
