"""Sequence parallelism for packed rows: each rank of a group runs one contiguous chunk of a row.

A packed row ``[1, T]`` is padded to a multiple of the group size ``n`` and cut into ``n`` equal
chunks; rank ``r`` of the group runs the model on chunk ``r`` only. Everything in a decoder is
per token except attention, which reaches the chunks of the other ranks through
:func:`raylign.models.ring_attention.ring_attention`. It is plugged into Hugging Face models
without touching their code: this module registers it as the attention implementation
``"raylign_ring"`` (``AttentionInterface.register``), and a model loaded with
``attn_implementation="raylign_ring"`` calls it in every layer. Which group and which tokens the
chunk holds is set for the duration of a forward pass with :func:`sequence_shard`; with no shard
set the same model runs plain causal attention over its input, keeping packed samples apart by
their ``position_ids``, so evaluation and single-rank use need nothing special.

``engine.sequence_parallel_mode: ulysses`` registers the other way to reach the other chunks,
``"raylign_ulysses"`` (:mod:`raylign.models.ulysses_attention`, DeepSpeed-Ulysses): an all-to-all
gives each rank the whole row of 1/n of the heads, which it attends over alone, and a second one
hands the chunks back. Everything else here (the chunks, targets and sums) is the same for both.

Next-token targets cross chunk boundaries (the last token of chunk r predicts the first of chunk
r + 1), so they are taken from the whole row before it is cut: each chunk carries
``target_ids`` and ``target_mask`` aligned to the position that predicts them.

Preference and KTO losses need each packed sequence's summed log-probs:
:func:`sharded_sequence_logprobs` sums each chunk's part per sequence and all-reduces the sums; a
reward model's score at each sequence's last token comes the same way from :func:`sharded_scores_at`.

RL's passes read a few positions of rows ``[B, L]`` (the response tokens):
:func:`sharded_selected_token_logprobs` runs each rank's chunk of every row, computes the
log-probs its chunk predicts, and sums the ranks' parts into the whole ``[b, R]`` on every rank
with an all-reduce that autograd differentiates; :func:`sharded_response_values` does the same for
a critic's values.

Gradient checkpointing re-runs a layer's forward in the backward pass, after
:func:`sequence_shard` has ended: :func:`shard_recompute_context`, which raylign passes to the
checkpointing, sets the shard again for the recomputation. Not supported yet: 2D attention masks
(padded batches), sliding windows, logit soft-capping and attention dropout.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from raylign.models.logprobs import (
    _place,
    entropy_from_logits,
    logits_only_at,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
)
from raylign.models.ring_attention import DEFAULT_TIMEOUT, ring_attention, sample_ids_from_position_ids
from raylign.models.ulysses_attention import ulysses_attention

RING_ATTENTION = "raylign_ring"
ULYSSES_ATTENTION = "raylign_ulysses"
# engine.sequence_parallel_mode -> the attention implementation a model splitting its rows computes with
SEQUENCE_ATTENTION = {"ring": RING_ATTENTION, "ulysses": ULYSSES_ATTENTION}


@dataclass(frozen=True)
class SequenceShard:
    """The chunk of a row that this rank runs, and the group that holds the other chunks.

    ``token_index`` and ``sample_ids`` are ``[B, S]``: each local token's index in the whole row and
    the packed sample it belongs to (ids shared by the whole row, so equal ids on two ranks mean the
    same sample).
    """

    group: dist.ProcessGroup | None
    token_index: torch.Tensor
    sample_ids: torch.Tensor
    timeout: datetime.timedelta = DEFAULT_TIMEOUT


_ACTIVE_SHARD: ContextVar[SequenceShard | None] = ContextVar("raylign_sequence_shard", default=None)


@contextmanager
def sequence_shard(shard: SequenceShard) -> Iterator[None]:
    """Within the block, ``raylign_ring`` attention treats its input as ``shard``'s chunk of a longer row."""
    token = _ACTIVE_SHARD.set(shard)
    try:
        yield
    finally:
        _ACTIVE_SHARD.reset(token)


def shard_recompute_context() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` of ``torch.utils.checkpoint`` (non-reentrant): a checkpointed layer recomputed in
    the backward pass, after :func:`sequence_shard` has ended, runs under the shard its forward ran
    under, so its ring attention reaches the other ranks' chunks again."""
    shard = _ACTIVE_SHARD.get(None)
    return nullcontext(), (nullcontext() if shard is None else sequence_shard(shard))


def _unsupported(what: str, hint: str = "") -> ValueError:
    return ValueError(f"{RING_ATTENTION} attention does not support {what} yet{hint}")


def _active_shard(
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    sliding_window: int | None,
    softcap: float | None,
    position_ids: torch.Tensor | None,
) -> SequenceShard:
    """The shard a sequence-parallel attention call runs under, refusing what it does not support;
    with none set, the whole input as one chunk (packed samples told apart by ``position_ids``)."""
    if attention_mask is not None:
        raise _unsupported("an attention mask", "; pass packed rows with position_ids instead")
    if dropout:
        raise _unsupported(f"attention dropout ({dropout})")
    if sliding_window is not None:
        raise _unsupported(f"sliding-window attention (window {sliding_window})")
    if softcap is not None:
        raise _unsupported(f"logit soft-capping ({softcap})")
    shard = _ACTIVE_SHARD.get(None)  # a context variable, not a queue: nothing to wait for
    if shard is not None:
        return shard
    batch, _, length, _ = query.shape
    token_index = torch.arange(length, device=query.device).expand(batch, length)
    if position_ids is None:
        sample_ids = torch.zeros_like(token_index)
    else:
        sample_ids = sample_ids_from_position_ids(position_ids.to(query.device)).expand(batch, length)
    return SequenceShard(None, token_index, sample_ids)


def _in_ring(query, key, value, token_index, sample_ids, scale, shard: SequenceShard) -> torch.Tensor:
    return ring_attention(
        query, key, value, token_index, sample_ids, scale=scale, group=shard.group, timeout=shard.timeout
    )


def _in_ulysses(query, key, value, token_index, sample_ids, scale, shard: SequenceShard) -> torch.Tensor:
    return ulysses_attention(query, key, value, token_index, sample_ids, scale, shard.group)


def _hf_attention(kernel: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, None]]:
    """Transformers' attention-function signature around a sequence-parallel ``kernel`` (ring or Ulysses)."""

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """Output ``[B, S, H, D]``, as transformers' attention functions return it."""
        shard = _active_shard(query, attention_mask, dropout, sliding_window, softcap, kwargs.get("position_ids"))
        token_index, sample_ids = _labels_with_padding(shard, query.shape[2])
        out = kernel(query, key, value, token_index.to(query.device), sample_ids.to(query.device), scaling, shard)
        return out.transpose(1, 2).contiguous(), None

    return attention


def _labels_with_padding(shard: SequenceShard, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard's token labels for a chunk of ``length`` tokens. Under tensor parallel with its activations
    split along the sequence (:mod:`raylign.engine.sequence_sharded_activations`) each rank's chunk arrives
    padded on the right to a multiple of the tensor-parallel size, the same padding on every rank of the
    group: it is labelled a sample of its own on each rank (ids below 0, which no packed sample has, one per
    rank), so no real token attends to it and it attends to nothing of another rank."""
    extra = length - shard.token_index.shape[1]
    if extra == 0:
        return shard.token_index, shard.sample_ids
    if extra < 0:
        raise ValueError(f"{RING_ATTENTION}: a chunk of {length} tokens under a shard of {shard.token_index.shape[1]}")
    rows = shard.token_index.shape[0]
    own = -1 - (0 if shard.group is None else dist.get_rank(shard.group))
    after = shard.token_index[:, -1:] + 1 + torch.arange(extra, device=shard.token_index.device)
    token_index = torch.cat([shard.token_index, after], dim=1)
    sample_ids = torch.cat([shard.sample_ids, shard.sample_ids.new_full((rows, extra), own)], dim=1)
    return token_index, sample_ids


def _refuse_padding(*, attention_mask: torch.Tensor | None = None, **_: Any) -> None:
    """The mask builder transformers calls for ``raylign_ring``: the attention needs no mask (it works from
    the shard's labels), and a padding mask it would have to drop is an error rather than ignored."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise _unsupported("padded batches (an attention mask with zeros)", "; pack the rows instead")
    return None


for _name, _kernel in ((RING_ATTENTION, _in_ring), (ULYSSES_ATTENTION, _in_ulysses)):
    AttentionInterface.register(_name, _hf_attention(_kernel))
    AttentionMaskInterface.register(_name, _refuse_padding)


def _pad_right(tensor: torch.Tensor, length: int, value: int) -> torch.Tensor:
    return nn.functional.pad(tensor, (0, length - tensor.shape[-1]), value=value)


def shard_packed_batch(
    batch: dict[str, torch.Tensor], rank: int, size: int, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Chunk ``rank`` of ``size`` of a packed batch (``input_ids``, ``position_ids``, ``loss_mask``, ``[B, T]``).

    Returns ``input_ids``, ``position_ids``, ``token_index``, ``sample_ids``, ``target_ids`` and
    ``target_mask``, each ``[B, ceil(T / size)]``: ``target_ids[t]`` is the token after ``t`` in the
    whole row, and ``target_mask[t]`` is 1 where that token is trained on (its loss mask is 1 and it
    belongs to the same sample as ``t``). Rows are padded on the right to a multiple of ``size`` with
    ``pad_token_id`` tokens that form a sample of their own and are never targets. A batch with
    ``seq_starts`` and ``seq_lens`` (from :func:`raylign.data.collate_packed`) also gets
    ``sequence_ids``: the index of the sequence each position belongs to, as
    :func:`sharded_sequence_logprobs` sums by.
    """
    input_ids, position_ids, loss_mask = batch["input_ids"], batch["position_ids"], batch["loss_mask"]
    total = input_ids.shape[-1]
    padded = math.ceil(total / size) * size
    target_ids = _pad_right(input_ids[:, 1:], total, pad_token_id)
    same_sample = position_ids[:, 1:] == position_ids[:, :-1] + 1
    target_mask = _pad_right((loss_mask[:, 1:].bool() & same_sample).long(), total, 0)
    padding_positions = torch.arange(padded - total, device=position_ids.device).expand(position_ids.shape[0], -1)
    full = {
        "input_ids": _pad_right(input_ids, padded, pad_token_id),
        "position_ids": torch.cat([position_ids, padding_positions], dim=-1),
        "token_index": torch.arange(padded, device=input_ids.device).expand(input_ids.shape[0], -1),
        "target_ids": _pad_right(target_ids, padded, pad_token_id),
        "target_mask": _pad_right(target_mask, padded, 0),
    }
    full["sample_ids"] = sample_ids_from_position_ids(full["position_ids"])  # padding restarts at 0: its own sample
    if "seq_starts" in batch:
        full["sequence_ids"] = _pad_right(_sequence_ids(batch, total), padded, int(batch["seq_lens"].numel()))
    return {name: chunk_of_row(tensor, rank, size) for name, tensor in full.items()}


def chunk_of_row(tensor: torch.Tensor, rank: int, size: int, fill: float = 0) -> torch.Tensor:
    """Chunk ``rank`` of ``size`` of every row of ``tensor`` ``[B, T, ...]``, as :func:`shard_packed_batch`
    cuts a batch: rows padded on the right to a multiple of ``size`` with ``fill``, then cut evenly."""
    total = tensor.shape[1]
    padded = math.ceil(total / size) * size
    if padded > total:
        tail = torch.full((tensor.shape[0], padded - total, *tensor.shape[2:]), fill, dtype=tensor.dtype)
        tensor = torch.cat([tensor, tail.to(tensor.device)], dim=1)
    chunk = padded // size
    return tensor[:, rank * chunk : (rank + 1) * chunk].contiguous()


def _sequence_ids(batch: dict[str, torch.Tensor], length: int) -> torch.Tensor:
    """``[B, length]``: the index of the packed sequence each position of the rows belongs to (the
    ``seq_starts`` / ``seq_lens`` order of :func:`raylign.data.collate_packed`), the number of sequences
    at a row's padding."""
    from raylign.models.logprobs import packed_token_positions

    seq_starts, seq_lens = batch["seq_starts"], batch["seq_lens"]
    owner, positions = packed_token_positions(seq_starts, seq_lens)
    ids = torch.full((batch["input_ids"].numel(),), seq_lens.numel(), dtype=torch.long, device=seq_starts.device)
    ids[positions] = owner
    return ids.reshape(-1, length)


def sharded_target_logprobs(
    model: nn.Module,
    chunk: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``log p(target_ids[t] | the sample's tokens up to t)`` for a chunk from :func:`shard_packed_batch`,
    float32 ``[B, S]``, 0 where ``target_mask`` is 0. Collective over ``group``: every rank runs its chunk.
    """
    logits = sharded_logits(model, chunk, group, timeout)
    logprobs = logprobs_from_logits(logits, chunk["target_ids"], temperature)
    return logprobs * chunk["target_mask"].to(logprobs.dtype)


def sharded_logits(
    model: nn.Module,
    chunk: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> torch.Tensor:
    """The model's logits ``[B, S, V]`` at every position of a chunk from :func:`shard_packed_batch`, its
    attention reaching the other ranks' chunks. Collective over ``group``: every rank runs its chunk."""
    shard = SequenceShard(group, chunk["token_index"], chunk["sample_ids"], timeout)
    with sequence_shard(shard):
        return model(input_ids=chunk["input_ids"], position_ids=chunk["position_ids"], use_cache=False).logits


def sharded_sequence_logprobs(
    model: nn.Module,
    chunk: dict[str, torch.Tensor],
    num_sequences: int,
    group: dist.ProcessGroup | None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> torch.Tensor:
    """:func:`raylign.models.sequence_logprobs` of a packed batch cut by :func:`shard_packed_batch`: the
    summed log-probs of each sequence's scored tokens, float32 ``[num_sequences]``, the same on every
    rank of ``group``, which compute it together (each its chunk's part; an all-reduce sums the parts).

    A loss every rank computes from the whole result gets, through the all-reduce's backward, ``size``
    times its chunk's share of the gradient on each rank, as :func:`sharded_selected_token_logprobs`
    explains. Collective over ``group``.
    """
    from torch.distributed.nn.functional import all_reduce

    scored = sharded_target_logprobs(model, chunk, group, timeout).reshape(-1)
    parts = torch.zeros(num_sequences + 1, dtype=scored.dtype, device=scored.device)  # the last: padding
    parts = parts.index_add(0, chunk["sequence_ids"].reshape(-1).to(scored.device), scored)[:num_sequences]
    return parts if group is None else all_reduce(parts, group=group)


def sharded_scores_at(
    model: nn.Module,
    chunk: dict[str, torch.Tensor],
    positions: torch.Tensor,
    group: dist.ProcessGroup | None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> torch.Tensor:
    """A one-label score model's output at ``positions`` ``[N]`` of the whole row that
    :func:`shard_packed_batch` cut into ``chunk`` (a reward model's score at each sequence's last
    token), float32 ``[N]``, the same on every rank of ``group``: the rank whose chunk holds a position
    reads it, an all-reduce sums the parts (its gradient scaled as in
    :func:`sharded_selected_token_logprobs`). Collective over ``group``."""
    from torch.distributed.nn.functional import all_reduce

    from raylign.models.heads import token_scores

    shard = SequenceShard(group, chunk["token_index"], chunk["sample_ids"], timeout)
    with sequence_shard(shard):
        scores = token_scores(model, chunk["input_ids"], position_ids=chunk["position_ids"]).reshape(-1)
    local = positions.to(scores.device) - chunk["token_index"].reshape(-1)[0].to(scores.device)
    mine = (local >= 0) & (local < scores.numel())
    # A rank that holds none of the positions keeps a zero-weight term of its chunk, so its backward runs.
    parts = torch.where(mine, scores[local.clamp(0, scores.numel() - 1)], 0.0) + scores[:1] * 0
    return parts if group is None else all_reduce(parts, group=group)


def _chunk_of_rows(
    input_ids: torch.Tensor, position_ids: torch.Tensor, rank: int, size: int, pad_token_id: int
) -> tuple[dict[str, torch.Tensor], int]:
    """Chunk ``rank`` of ``size`` of every row of ``[B, L]`` (rows padded on the right to a multiple of
    ``size`` with tokens that form a sample of their own), and the chunk's length."""
    length = input_ids.shape[-1]
    padded = math.ceil(length / size) * size
    tail = torch.arange(padded - length, device=position_ids.device).expand(position_ids.shape[0], -1)
    full_positions = torch.cat([position_ids, tail], dim=-1)
    full = {
        "input_ids": _pad_right(input_ids, padded, pad_token_id),
        "position_ids": full_positions,
        "token_index": torch.arange(padded, device=input_ids.device).expand(input_ids.shape[0], -1),
        "sample_ids": sample_ids_from_position_ids(full_positions),
    }
    chunk = padded // size
    return {name: t[:, rank * chunk : (rank + 1) * chunk].contiguous() for name, t in full.items()}, chunk


def sharded_selected_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    token_index: torch.Tensor,
    position_ids: torch.Tensor,
    group: dist.ProcessGroup,
    temperature: float = 1.0,
    with_entropy: bool = False,
    mask: torch.Tensor | None = None,
    entropy_grad: bool = True,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`raylign.models.selected_token_logprobs` of packed rows ``[B, L]``, computed by the ranks of
    ``group`` together, each running one chunk of every row: the same values on every rank.

    The entry for flat position ``i`` (row ``i // L``) is computed by the rank whose chunk holds the
    predicting position ``i - 1``; the ranks' parts (0 elsewhere) are summed by an all-reduce. Its
    backward all-reduces the gradient too, so a loss every rank computes from the whole result gives
    each rank ``size`` times its chunk's share of the gradient: averaged over the ``size`` ranks, as
    data-parallel gradient averaging does, that is the whole row's gradient. Collective over ``group``.
    """
    from torch.distributed.nn.functional import all_reduce

    chunk, index, mine, local = _predictors_in_chunk(input_ids, token_index, position_ids, group, mask)
    # A rank with nothing to read still runs one position, so its output layer takes part in the
    # backward pass (its parameters may be sharded across the data-parallel ranks).
    rows = local if local.numel() else torch.zeros(1, dtype=torch.long, device=index.device)
    shard = SequenceShard(group, chunk["token_index"], chunk["sample_ids"], timeout)
    with sequence_shard(shard), logits_only_at(model, rows):
        logits = model(input_ids=chunk["input_ids"], position_ids=chunk["position_ids"], use_cache=False).logits[0]
    labels = input_ids.reshape(-1)[index[mine]] if local.numel() else input_ids.reshape(-1)[:1]
    if with_entropy and not entropy_grad:
        mine_logprobs, mine_entropy = logprobs_and_entropy_from_logits(logits, labels, temperature)
    else:
        mine_logprobs = logprobs_from_logits(logits, labels, temperature)
    logprobs = all_reduce(_place(mine, mine_logprobs).reshape(token_index.shape), group=group)
    if not with_entropy:
        return logprobs
    if entropy_grad:
        entropy = _place(mine, entropy_from_logits(logits, temperature)).reshape(token_index.shape)
        return logprobs, all_reduce(entropy, group=group)
    entropy = _place(mine, mine_entropy).reshape(token_index.shape)
    dist.all_reduce(entropy, group=group)
    return logprobs, entropy


def _predictors_in_chunk(
    input_ids: torch.Tensor,
    token_index: torch.Tensor,
    position_ids: torch.Tensor,
    group: dist.ProcessGroup,
    mask: torch.Tensor | None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's chunk of the rows; the flat ``token_index``; which of its (masked-in) entries this rank
    computes, those whose predicting position ``i - 1`` lies in its chunk; and those positions in the
    chunk's flattened ``[B * width]``."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    chunk, width = _chunk_of_rows(input_ids, position_ids, rank, size, pad_token_id=0)
    index = token_index.reshape(-1)
    keep = torch.ones_like(index, dtype=torch.bool) if mask is None else mask.reshape(-1).to(torch.bool)
    length = input_ids.shape[-1]
    predictor = (index - 1).clamp(min=0)
    row, column = predictor // length, predictor % length
    mine = keep & (column // width == rank)
    return chunk, index, mine, (row * width + column % width)[mine]


def sharded_response_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    token_index: torch.Tensor,
    position_ids: torch.Tensor,
    group: dist.ProcessGroup,
    mask: torch.Tensor | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> torch.Tensor:
    """A one-label score model's output at the position before each ``token_index`` entry (a critic's
    value of the state each response token is chosen in), float32 shaped like ``token_index``, 0 where
    ``mask`` is 0: what ``gather_responses(token_scores(...), token_index, mask, shift=-1)`` gives on one
    rank, computed by the ranks of ``group`` together as :func:`sharded_selected_token_logprobs` does
    (the same all-reduce, the same gradient scaling). Collective over ``group``."""
    from torch.distributed.nn.functional import all_reduce

    from raylign.models.heads import token_scores

    chunk, _, mine, local = _predictors_in_chunk(input_ids, token_index, position_ids, group, mask)
    shard = SequenceShard(group, chunk["token_index"], chunk["sample_ids"], timeout)
    with sequence_shard(shard):
        scores = token_scores(model, chunk["input_ids"], position_ids=chunk["position_ids"])
    # Every rank's head reads its whole chunk; a rank with nothing to read keeps a zero-weight term of it.
    values = scores.reshape(-1)[local] if local.numel() else scores.reshape(-1)[:1] * 0
    return all_reduce(_place(mine, values).reshape(token_index.shape), group=group)
