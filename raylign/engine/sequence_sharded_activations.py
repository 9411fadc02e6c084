"""Tensor parallel with the activations between the split matrices split along the sequence.

Megatron-LM's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models"). Plain tensor parallel leaves every rank of a group the whole residual
stream, and every norm runs on all of it on every rank. Here each of the T ranks keeps 1/T of the
sequence between the blocks: the attention and the MLP all-gather their input along the sequence
first (in place of taking it whole), and their last, row-split layer reduce-scatters its output
along the sequence (in place of all-reducing it). An all-reduce is a reduce-scatter plus an
all-gather, so the bytes moved are the same. The norms' inputs, which they keep for the backward,
and under gradient checkpointing each layer's saved input, shrink T-fold; the gathered inputs of the
projections, which the projections keep, stay whole.

The sequence of a forward is padded on the right to a multiple of T at the backbone's entry (its
own sample, never read) and the padding dropped from its output; the first decoder layer takes its
rank's part of the sequence, and the final norm's output is gathered whole again, so what the model
hands out (hidden states, logits, scores) is as without tensor parallel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

# transformers' tensor-parallel styles -> the same split handing its output to the residual stream
# split along the sequence (registered with transformers under these names).
SEQUENCE_STYLES = {"rowwise": "raylign_rowwise_to_sequence"}
NORM_STYLE = "sequence_parallel"  # transformers' own: the norm runs on this rank's part of the sequence
# Each decoder layer's norms, and the blocks that take the whole sequence (Llama, Qwen2/3, Mistral).
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
BLOCKS = ("self_attn", "mlp")


def register_styles() -> None:
    """Register the style of :data:`SEQUENCE_STYLES` with transformers (once per process is enough)."""
    from transformers.distributed.tensor_parallel import ParallelInterface, RowwiseParallel

    style = RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(1))
    ParallelInterface.register(SEQUENCE_STYLES["rowwise"], style)


def sequence_sharded_plan(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` (transformers' plan for ``model``, a ``PreTrainedModel``) with the activations between
    the blocks split along the sequence: row-split layers hand their output on split so, and the norms
    of each decoder layer and the final norm run on their rank's part. Raises, naming the model, where the model is not
    built as the decoders this is written for (the attention and MLP projections split column- then
    row-wise, and two norms around them in every decoder layer)."""
    backbone = model.base_model
    layers = getattr(backbone, "layers", None)
    styles = {value for key, value in plan.items() if ".layers.*." in key}
    fits = (
        layers is not None
        and len(layers) > 0
        and all(hasattr(layers[0], name) for name in (*LAYER_NORMS, *BLOCKS))
        and hasattr(backbone, "norm")
        and styles == {"colwise", "rowwise"}
    )
    if not fits:
        raise ValueError(
            f"engine.tensor_parallel_shard_activations: {type(model).__name__} is not built as the decoders it "
            f"supports (Llama, Qwen2, Qwen3, Mistral: decoder layers with {', '.join((*LAYER_NORMS, *BLOCKS))}, "
            f"split colwise and rowwise; its plan has {sorted(styles)}); set it to false"
        )
    sharded = {key: SEQUENCE_STYLES.get(style, style) if ".layers.*." in key else style for key, style in plan.items()}
    names = {id(module): name for name, module in model.named_modules()}
    for norm in LAYER_NORMS:
        sharded[f"{names[id(layers)]}.*.{norm}"] = NORM_STYLE
    sharded[names[id(backbone.norm)]] = NORM_STYLE  # the final norm, gathered whole after it
    return sharded


def shard_activations_by_sequence(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Install what moves the residual stream between whole and sequence-split on ``model`` (a
    ``PreTrainedModel`` whose plan came from :func:`sequence_sharded_plan`): the backbone pads its input
    to a multiple of the group's size and drops the padding from its output, the first decoder layer
    keeps its rank's part of the sequence, each attention and MLP gathers its input whole, and the final
    norm's output is gathered whole."""
    backbone = model.base_model
    size = mesh.size()

    def pad(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if args:  # score models hand the backbone their input_ids by position
            kwargs, args = {"input_ids": args[0], **kwargs}, args[1:]
        if args:
            raise TypeError(
                f"{type(backbone).__name__} under tensor parallel takes its inputs after input_ids by keyword"
            )
        if kwargs.get("past_key_values") is not None:
            raise RuntimeError(
                "engine.tensor_parallel_shard_activations: a forward with a KV cache (generation) cannot split "
                "its sequence over the tensor-parallel ranks; set it to false"
            )
        tokens = kwargs.get("input_ids")
        source = tokens if tokens is not None else kwargs["inputs_embeds"]
        length = source.shape[1]
        extra = -length % size
        backbone._unpadded_length = length
        if extra == 0:
            return args, kwargs
        rows = source.shape[0]
        if tokens is not None:
            kwargs["input_ids"] = torch.cat([tokens, tokens.new_zeros(rows, extra)], dim=1)
        else:
            embeds = kwargs["inputs_embeds"]
            kwargs["inputs_embeds"] = torch.cat([embeds, embeds.new_zeros(rows, extra, embeds.shape[-1])], dim=1)
        positions = kwargs.get("position_ids")
        if positions is not None:  # the padding is a sample of its own: its positions start again at 0
            padding = torch.arange(extra, device=positions.device, dtype=positions.dtype).expand(rows, -1)
            kwargs["position_ids"] = torch.cat([positions, padding], dim=1)
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2:
                raise ValueError(
                    "engine.tensor_parallel_shard_activations pads a [batch, sequence] attention mask only "
                    f"(got {mask.dim()} dimensions)"
                )
            # Ones, not zeros: the padding follows every real token, so it changes none of them, and a
            # query that may attend to nothing would give NaN, which its zero gradient does not cancel.
            kwargs["attention_mask"] = torch.cat([mask, mask.new_ones(rows, extra)], dim=1)
        return args, kwargs

    def unpad(_module: torch.nn.Module, _args: tuple, _kwargs: dict[str, Any], output: Any) -> Any:
        length = backbone._unpadded_length
        if output.last_hidden_state.shape[1] != length:
            output.last_hidden_state = output.last_hidden_state[:, :length]
        return output

    def on_hidden_states(change: Any) -> Any:
        """A forward pre-hook that hands the module ``change(hidden_states)`` in place of them."""

        def hook(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            if args:
                return (change(args[0], mesh), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"], mesh)}

        return hook

    backbone.register_forward_pre_hook(pad, with_kwargs=True)
    backbone.register_forward_hook(unpad, with_kwargs=True)
    backbone.layers[0].register_forward_pre_hook(on_hidden_states(_split), with_kwargs=True)
    for layer in backbone.layers:
        for block in BLOCKS:
            getattr(layer, block).register_forward_pre_hook(on_hidden_states(_gather), with_kwargs=True)
    backbone.norm.register_forward_hook(lambda _module, _args, output: _gather(output, mesh))


def _split(whole: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's part of the sequence of ``whole`` (the same on every rank); its gradient is gathered
    from all parts in the backward."""
    return DTensor.from_local(whole, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


def _gather(part: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole sequence from every rank's ``part`` (all of equal length)."""
    return DTensor.from_local(part, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()
