"""Attention that keeps packed samples apart by computing each sample on its own.

A packed row holds several samples, ``position_ids`` restarting at 0 at each (see
:mod:`raylign.models.packing`). Transformers' ``sdpa`` keeps them apart with a dense
``[row, row]`` block-causal mask: the kernel then computes every query against every key of the
row, other samples' and future tokens included, a cost that grows with the square of the row.
Rows were therefore cut about as long as the longest sample, and the padding that left (a
quarter to a third of the tokens of a long-tailed RL batch) went through every matrix product.

``raylign_sdpa`` instead runs causal ``scaled_dot_product_attention`` on each sample's span of the
row (samples of equal length in one batched call, :func:`row_attention`): the work is the sum of the
samples' own causal attention, whatever the row's length, so a micro-batch packs into one row
without padding. Everything else (a padding mask, a KV cache,
decoding, a sliding window) goes to transformers' own ``sdpa`` unchanged.

On a CPU without AMX, bf16 attention is computed in float32 (:func:`computes_in_float32`).

Models are switched to it at load time (:func:`keep_samples_apart`) when they ask for ``sdpa``
and their attention is plain causal attention that receives the ``position_ids``
(:data:`PER_SAMPLE_MODEL_TYPES`, no sliding window, no soft-capping).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from raylign.hardware import cpu_flags

PER_SAMPLE_SDPA = "raylign_sdpa"

ModelT = TypeVar("ModelT", bound=nn.Module)

# Decoders whose attention layers pass ``position_ids`` on to the attention function (checked in
# transformers 5's modelling code) and apply plain causal attention.
PER_SAMPLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def sample_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``position_ids`` ``[B, T]``, the ``(start, end)`` of each packed sample: a new sample
    starts wherever the position does not grow by one (as transformers' own packed-mask detection)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    length = position_ids.shape[1]
    spans = []
    for row in starts.cpu():
        begins = row.nonzero().flatten().tolist()
        spans.append(list(zip(begins, [*begins[1:], length])))
    return spans


def per_sample_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature: ``query`` ``[B, H, T, D]``, ``key`` / ``value``
    ``[B, H_kv, T, D]``; output ``[B, T, H, D]``. Causal attention within each packed sample of each row
    (spans from ``kwargs["position_ids"]``); transformers' ``sdpa`` wherever that is not the case."""
    position_ids = kwargs.get("position_ids")
    plain = (
        attention_mask is None
        and query.shape[2] == key.shape[2]
        and getattr(module, "is_causal", True)
        and kwargs.get("sliding_window") is None
        and kwargs.get("softcap") is None
    )
    if position_ids is None or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    grouped = query.shape[1] != key.shape[1]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=grouped
        )

    dtype = query.dtype
    if computes_in_float32(query):
        query, key, value = query.float(), key.float(), value.float()
    plans = row_plans(position_ids, query.shape[0])
    rows = [row_attention(query[b], key[b], value[b], plan, attend) for b, plan in enumerate(plans)]
    return torch.stack(rows).transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), None


def computes_in_float32(query: torch.Tensor) -> bool:
    """Whether ``raylign_sdpa`` computes ``query``'s attention in float32: bf16 on a CPU without AMX.

    torch's CPU flash-attention kernel packs bf16 blocks for its fast micro-kernels only where the CPU has
    AMX; elsewhere every block goes through a general bf16 matrix product with conversions around it, and
    on SmolLM2-135M's samples its backward pass took 1.5x the time of the float32 kernel's on the same
    values cast up (2-core AMD EPYC with AVX512-BF16; a policy update 6% faster in all, its forward pass
    as fast). The output is rounded back to bf16, so it differs from the bf16 kernel's by that rounding.
    Forward-only passes take the same path: an evaluation and a training forward of the same weights
    give the same log-probs."""
    return query.device.type == "cpu" and query.dtype == torch.bfloat16 and "amx_bf16" not in cpu_flags()


@dataclass(frozen=True)
class RowPlan:
    """How one packed row's attention is computed (see :func:`row_attention`).

    ``spans``: each sample's ``(start, end)``. ``groups``: where some length occurs more than once, per
    distinct length (in order of first appearance) the indices in ``spans`` of its samples; empty where
    every length occurs once: each sample is then attended on its own span."""

    spans: list[tuple[int, int]]
    groups: list[list[int]]


def row_plan(spans: list[tuple[int, int]]) -> RowPlan:
    by_length: dict[int, list[int]] = {}
    for i, (start, end) in enumerate(spans):
        by_length.setdefault(end - start, []).append(i)
    return RowPlan(spans, [] if len(by_length) == len(spans) else list(by_length.values()))


class _LastPlans(threading.local):
    """The plans of the last ``position_ids`` seen in this thread (a weak reference to the tensor, and
    its version counter, shape, device and the batch size they were made for)."""

    source: weakref.ref[torch.Tensor] | None = None
    key: tuple[Any, ...] = ()
    plans: list[RowPlan] = []


_LAST_PLANS = _LastPlans()


def row_plans(position_ids: torch.Tensor, batch: int) -> list[RowPlan]:
    """The :class:`RowPlan` of each of ``batch`` rows of ``position_ids`` (``[B or 1, T]``).

    Every layer of a forward pass receives the same ``position_ids`` tensor: its plans are worked out at
    the first layer and reused by the others (and by the recomputation of activation checkpointing), so
    a forward pass reads the positions back from the device once, not once per layer (each read waits
    for the device to finish everything queued before it). A tensor changed in place since gets new
    plans (its version counter moved), as does any other tensor. An inference-mode tensor, which has no
    version counter, gets new plans at every call."""
    inference = position_ids.is_inference()
    key = (None if inference else position_ids._version, batch, tuple(position_ids.shape), position_ids.device)
    last = _LAST_PLANS
    if not inference and last.source is not None and last.source() is position_ids and last.key == key:
        return last.plans
    spans = sample_spans(position_ids.expand(batch, -1))
    plans = [row_plan(row_spans) for row_spans in spans]
    if not inference:
        last.source, last.key, last.plans = weakref.ref(position_ids), key, plans
    return plans


def row_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: RowPlan,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """One packed row's attention, ``query`` ``[H, T, D]`` (``key`` / ``value`` ``[H_kv, T, D]``), each
    sample causal over its own span; output ``[H, T, D]``.

    Samples of equal length go through ``attend`` together, stacked into one batch, and the outputs are
    put back in row order: a micro-batch of many short answers (the quickstart packs a hundred samples
    of a handful of lengths into a row) costs a few calls instead of one per sample. A sample whose
    length occurs once is attended on its own span, with no copy.

    The spans are views from one ``split``, whose backward writes every sample's gradient into one
    tensor of the row in a single pass. Slicing or gathering a sample (or a group) at a time would give
    each its own zero-filled gradient of the whole row, summed into the next: work of samples x row
    length per layer in the backward pass (5% of a policy update of SmolLM2-135M on a CPU)."""
    sizes = [end - start for start, end in plan.spans]
    pieces = [t.split(sizes, dim=1) for t in (query, key, value)]
    if not plan.groups:
        # [1, heads, L, D]: GPU kernels take 4-D inputs only (others fall back to the math kernel)
        return torch.cat([attend(q[None], k[None], v[None])[0] for q, k, v in zip(*pieces)], dim=1)
    outputs: dict[int, torch.Tensor] = {}
    for members in plan.groups:
        batch = [torch.stack([p[i] for i in members]) if len(members) > 1 else p[members[0]][None] for p in pieces]
        outputs.update(zip(members, attend(*batch).unbind(0)))
    return torch.cat([outputs[i] for i in range(len(sizes))], dim=1)


def per_sample_mask(
    *,
    q_length: int,
    kv_length: int,
    attention_mask: torch.Tensor | None = None,
    kv_offset: int = 0,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask builder transformers calls for ``raylign_sdpa``: none where the attention works from the
    ``position_ids`` alone (no padding, no cached keys), transformers' ``sdpa`` mask otherwise."""
    unpadded = attention_mask is None or bool(attention_mask.all())
    if unpadded and q_length == kv_length and kv_offset == 0:
        return None
    return sdpa_mask(
        q_length=q_length, kv_length=kv_length, attention_mask=attention_mask, kv_offset=kv_offset, **kwargs
    )


AttentionInterface.register(PER_SAMPLE_SDPA, per_sample_attention)
AttentionMaskInterface.register(PER_SAMPLE_SDPA, per_sample_mask)


def computes_samples_apart(config: Any) -> bool:
    """Whether a model of ``config`` can run ``raylign_sdpa``: a listed decoder with plain causal attention."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sliding = getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)
    layer_types = getattr(text, "layer_types", None) or []
    return (
        getattr(text, "model_type", None) in PER_SAMPLE_MODEL_TYPES
        and not sliding
        and "sliding_attention" not in layer_types
        and getattr(text, "attn_logit_softcapping", None) is None
    )


def keep_samples_apart(model: ModelT) -> ModelT:
    """Switch a model loaded with ``sdpa`` to ``raylign_sdpa`` where it can run it (see the module
    docstring); any other model, or another kernel, is left as it is. Returns the model."""
    config = getattr(model, "config", None)
    if config is not None and config._attn_implementation == "sdpa" and computes_samples_apart(config):
        model.set_attn_implementation(PER_SAMPLE_SDPA)  # type: ignore[operator]  # a PreTrainedModel's
    return model


ONE_ROW = 1 << 62  # a row length that packs every sample of a micro-batch into one row


def runs_samples_apart(models: list[Any]) -> bool:
    """Whether every one of ``models`` (model configs: ``path``, ``attn_implementation``,
    ``trust_remote_code``) attends within each packed sample on its own once loaded (``raylign_sdpa``,
    see :func:`keep_samples_apart`), read from the model folders' configs alone."""
    from transformers import AutoConfig

    from raylign.models.loading import resolve_model_path

    return all(
        m.attn_implementation == "sdpa"
        and computes_samples_apart(
            AutoConfig.from_pretrained(resolve_model_path(m.path), trust_remote_code=m.trust_remote_code)
        )
        for m in models
    )


def packed_row_tokens(row_tokens: int, samples_apart: bool) -> int:
    """Tokens per packed row for a ``pack_row_tokens`` setting: the setting when it is set; for 0, one
    row per micro-batch where the attention computes samples apart (padding is then all a row costs),
    else rows as long as the longest sample (a dense block mask costs the square of the row)."""
    if row_tokens or not samples_apart:
        return row_tokens
    return ONE_ROW
