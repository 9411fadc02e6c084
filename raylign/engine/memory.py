"""Memory per rank of a training run, estimated from the model's shape and the parallel layout.

What each rank holds while it trains a decoder-only transformer with AdamW, in bytes:

* **weights, gradients, optimizer state**: per parameter, the model dtype's bytes for the weights
  and their gradients, 4 + 4 more for fp32 master weights and gradients (a bf16 model with
  ``optim.master_weights``; fsdp2 keeps its sharded weights in fp32 instead), 8 for AdamW's two
  fp32 moments. Tensor parallel over ``t`` ranks splits the attention and MLP matrices, the
  embedding and the output head (what the transformers plan splits); fsdp2 and ZeRO-3 shard
  everything over the ``d`` data-parallel ranks, ZeRO-2 the gradients and the optimizer, ZeRO-1
  the optimizer. Offloaded state is counted on the host, not the device.
* **gathered layers** (fsdp2, ZeRO-3): the whole weights, in compute precision, of the layer that
  runs and the one prefetched, plus the embedding between the forward and the backward; with
  ``engine.reshard_after_forward: false`` every layer's.
* **activations**: what the backward pass needs, per token of a micro-batch. A decoder layer of
  width ``H``, MLP width ``I`` and key/value width ``K`` saves about ``8H + 4K + 4I`` values
  (the two norms' inputs and outputs, q/k/v before and after the rotary embedding, the attention
  output, the MLP's gate, up, activation and product); under tensor parallel the ``4H + 4K + 4I``
  inside attention and MLP are split, and with fsdp2's sequence-split activations
  (``engine.tensor_parallel_shard_activations``) so are the norms' inputs ``2H`` (their outputs
  are gathered whole for the projections, which keep them). With gradient checkpointing a layer
  keeps its input ``H`` (split likewise) and one layer's activations exist at a time. Sequence
  parallel splits the tokens.
* **logits**: 3.5 fp32 values per token and vocabulary entry (the logits, the log-softmax, its
  gradient, and part of a temporary), the largest single activation of small models.

Checked against the peak resident memory of real training steps on the CPU
(``tests/engine/test_memory_estimate.py``); not counted: the framework's own memory (a few
hundred MiB per process), allocator slack, communication buffers, the KV cache of rollout
engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
LOGIT_VALUES = 3.5  # fp32 values per token and vocabulary entry (see the module docstring)


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a decoder-only transformer's memory."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = False
    output_bias: bool = False  # the attention output projection's bias (Llama, Qwen3 ``attention_bias``)
    mlp_bias: bool = False  # Llama's ``mlp_bias``: gate, up and down projections
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of the queries and of the keys (head_dim each)

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """The shape of a transformers config (Llama, Qwen2/Qwen3, Mistral and alike)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        qwen2 = text.model_type == "qwen2"  # biases on q, k and v only, whatever the config says
        attention_bias = bool(getattr(text, "attention_bias", False))
        return cls(
            hidden=text.hidden_size,
            layers=text.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            intermediate=text.intermediate_size,
            vocab=text.vocab_size,
            tied=bool(getattr(text, "tie_word_embeddings", False)),
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            qkv_bias=qwen2 or attention_bias,
            output_bias=attention_bias and not qwen2,
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            qk_norm=text.model_type == "qwen3",
        )

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.dim

    def layer_params(self) -> tuple[int, int]:
        """One decoder layer's parameters: (in what tensor parallel splits, the rest: norms and the
        biases of row-split projections, which every rank keeps whole)."""
        q, kv = self.heads * self.dim, self.kv_width
        split = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        rest = 2 * self.hidden
        if self.qkv_bias:
            split += q + 2 * kv
        if self.output_bias:
            rest += self.hidden
        if self.mlp_bias:
            split, rest = split + 2 * self.intermediate, rest + self.hidden
        if self.qk_norm:
            rest += 2 * self.dim
        return split, rest

    def embedding_params(self) -> int:
        """The input embedding and, untied, the output head."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def params(self) -> int:
        split, rest = self.layer_params()
        return self.layers * (split + rest) + self.embedding_params() + self.hidden


# Shapes of the model sizes the documentation's table lists (the Qwen2.5 family).
KNOWN_SHAPES = {
    "0.5b": ModelShape(896, 24, 14, 2, 4864, 151936, tied=True, qkv_bias=True),
    "1.5b": ModelShape(1536, 28, 12, 2, 8960, 151936, tied=True, qkv_bias=True),
    "7b": ModelShape(3584, 28, 28, 4, 18944, 152064, qkv_bias=True),
    "32b": ModelShape(5120, 64, 40, 8, 27648, 152064, qkv_bias=True),
}


@dataclass(frozen=True)
class Layout:
    """How a run trains: dtype, backend and the parallel layout (the fields of ``engine``/``optim``)."""

    dtype: str = "bfloat16"  # the model's dtype: float32 or bfloat16
    backend: str = "fsdp2"  # local, fsdp2, deepspeed
    zero_stage: int = 2
    ranks: int = 1
    tensor_parallel: int = 1
    sequence_parallel: int = 1
    micro_batch_tokens: int = 4096
    gradient_checkpointing: bool = False
    master_weights: bool = True
    offload_params: bool = False
    offload_optimizer: bool = False
    reshard_after_forward: bool = True
    shard_activations: bool = True  # fsdp2 under tensor parallel: engine.tensor_parallel_shard_activations


@dataclass
class MemoryEstimate:
    """Bytes per rank, by what holds them; ``host`` lists what offloading keeps in host memory instead."""

    device: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.device.values())


def estimate_training_memory(shape: ModelShape, layout: Layout) -> MemoryEstimate:
    """Memory per rank of training ``shape`` with ``layout`` (see the module docstring)."""
    t, sp = layout.tensor_parallel, layout.sequence_parallel
    if layout.ranks % (t * sp):
        raise ValueError(f"{layout.ranks} ranks cannot hold tensor parallel {t} x sequence parallel {sp}")
    if layout.backend == "deepspeed" and layout.zero_stage == 3 and t > 1:
        raise ValueError("deepspeed's tensor parallel (AutoTP) runs with ZeRO stage 1 or 2, not 3")
    d = layout.ranks // t  # ranks each tensor-parallel slice is sharded over (sequence parallel shards too)
    width = 2 if layout.dtype == "bfloat16" else 4
    split, rest = shape.layer_params()
    per_rank = shape.layers * (split / t + rest) + shape.embedding_params() / t + shape.hidden
    master = width == 2 and layout.master_weights
    backend, stage = layout.backend, layout.zero_stage if layout.backend == "deepspeed" else 0
    if backend == "local":
        d = 1

    def sharded(on: bool) -> float:
        return per_rank / d if on else per_rank

    if backend == "fsdp2":  # fully_shard keeps the sharded weights (and gradients) in fp32 with master weights
        weight_bytes = gradient_bytes = 4 if master else width
        parts = {
            "weights": sharded(True) * weight_bytes,
            "gradients": sharded(True) * gradient_bytes,
            "optimizer": sharded(True) * 8,
        }
    else:
        parts = {
            "weights": sharded(stage == 3) * width,
            "gradients": sharded(stage >= 2) * width,
            "optimizer": sharded(stage >= 1) * 8,
        }
        if master:
            parts["master weights"] = sharded(stage >= 1) * 8  # fp32 weights and their gradients
    if backend == "fsdp2" or stage == 3:
        layer = (split / t + rest) * width
        gathered = shape.layers if not layout.reshard_after_forward else 2
        parts["gathered layers"] = gathered * layer + shape.vocab * shape.hidden / t * width
    tokens = layout.micro_batch_tokens / sp
    h, k, i = shape.hidden, shape.kv_width, shape.intermediate
    by_sequence = t if backend == "fsdp2" and layout.shard_activations else 1  # the residual stream's split
    per_layer = 2 * h / by_sequence + 2 * h + (4 * h + 4 * k + 4 * i) / t  # values per token
    # Checkpointed, a layer keeps its input, and one layer's activations exist at a time.
    kept = shape.layers * h / by_sequence + per_layer if layout.gradient_checkpointing else shape.layers * per_layer
    parts["activations"] = tokens * kept * width
    parts["logits"] = tokens * shape.vocab * 4 * LOGIT_VALUES
    estimate = MemoryEstimate(device=parts)
    if layout.offload_optimizer:
        for key in ("optimizer", "master weights"):
            if key in parts:
                estimate.host[key] = parts.pop(key)
    if layout.offload_params:
        for key in ("weights", "gradients"):
            estimate.host[key] = parts.pop(key)
    return estimate


def format_bytes(value: float) -> str:
    return f"{value / GIB:.2f} GiB" if value >= GIB / 10 else f"{value / (1 << 20):.0f} MiB"


def parameter_count(shape: ModelShape) -> str:
    """``shape``'s parameters as people say them (0.49B, 135M)."""
    n = shape.params()
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


class PhasePeak:
    """The peak memory of the work inside ``with PhasePeak(device) as peak:``, as :attr:`bytes` once it ends.

    On a CUDA device: the most memory torch's allocator had allocated on it (its peak counter, reset
    at the start). Elsewhere: the resident memory of this process at its highest (Linux's ``VmHWM``,
    reset at the start through ``/proc/self/clear_refs``), so the figure includes everything the process
    holds, not only what the phase allocated. None where neither can be read.
    """

    def __init__(self, device: Any):
        self.device = device
        self.bytes: int | None = None

    def __enter__(self) -> PhasePeak:
        import torch

        if getattr(self.device, "type", None) == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as refs:
                    refs.write("5")  # the high-water mark starts again from the resident size
            except OSError:
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        if getattr(self.device, "type", None) == "cuda":
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self.bytes = _resident_high_water_mark()


def _resident_high_water_mark() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
