"""Ring attention: exact causal attention over a sequence split across the ranks of a process group.

Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(2023, arXiv:2310.01889). Each of the ``n`` ranks holds the queries, keys and values of its own
chunk of a row. The key/value blocks travel around the ring (rank r sends to r + 1 and receives
from r - 1), so after ``n - 1`` hops every rank has seen every block while holding at most two
at a time. Per query row the partial results are merged with the log-sum-exp (online softmax)
rule, which makes the blockwise result exactly the full softmax:

    S_b = scale * Q K_b^T, masked to -inf where the key may not be attended
    lse_b = logsumexp_k S_b,   O_b = softmax(S_b) V_b
    lse = logaddexp(lse, lse_b),   O = O * exp(lse_old - lse) + O_b * exp(lse_b - lse)

Which keys a query may attend comes from two per-token labels that travel with each block:
the token's global index in the row (causal: key index <= query index) and the id of the packed
sample it belongs to (key sample == query sample), so attention never crosses sample
boundaries wherever the chunks cut the row. Fewer key/value heads than query heads (GQA) are
handled by grouping the query heads, without repeating the keys.

The backward pass is a second ring (a custom ``autograd.Function``, as in the paper and in
ring-flash-attn), recomputing each block's probabilities from the saved ``lse``:

    P_b = exp(S_b - lse),   D = rowsum(dO * O)
    dV_b = P_b^T dO,   dS_b = P_b * (dO V_b^T - D),   dQ += scale * dS_b K_b,   dK_b = scale * dS_b^T Q

dK_b and dV_b accumulate while travelling with their block, and one last hop brings them home.
Autograd through differentiable collectives would be simpler to write, but it would keep every
received block alive for the backward pass (the whole row's keys and values on every rank),
which is the memory ring attention exists to avoid; torch also has no differentiable send/recv.

Everything runs in float32 (float64 stays float64); blocks travel in the input dtype. This is
the pure-torch path that runs on CPU (gloo) and GPU alike; it computes the full ``S_b`` of a
block pair, so its memory grows with the square of the chunk length.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def sample_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Packed-sample id of each token, ``[..., T]``: a new sample starts wherever the position does not
    grow by one (the rule transformers uses for packed rows), counted from 0 in each row."""
    starts = torch.ones_like(position_ids, dtype=torch.long)
    starts[..., 1:] = (position_ids[..., 1:] != position_ids[..., :-1] + 1).long()
    return starts.cumsum(-1) - 1


def attention_allowed(
    query_index: torch.Tensor, query_sample: torch.Tensor, key_index: torch.Tensor, key_sample: torch.Tensor
) -> torch.Tensor:
    """Bool ``[B, Sq, Sk]``: the key is at or before the query and in the same packed sample."""
    causal = key_index[:, None, :] <= query_index[:, :, None]
    same_sample = key_sample[:, None, :] == query_sample[:, :, None]
    return causal & same_sample


def _group_heads(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hq, S, D]`` -> ``[B, Hkv, G, S, D]``: query head h uses key/value head h // G."""
    batch, heads, length, dim = query.shape
    if heads % num_kv_heads:
        raise ValueError(f"{heads} query heads cannot share {num_kv_heads} key/value heads evenly")
    return query.reshape(batch, num_kv_heads, heads // num_kv_heads, length, dim)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, G, Sq, Sk]`` attention logits, -inf where not ``allowed``."""
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    return scores.masked_fill(~allowed[:, None, None], float("-inf"))


def _merge_block(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one key/value block into the running ``(out, lse)``; rows with no allowed key are unchanged."""
    scores = _scores(q, k, scale, allowed)
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)  # unnormalised, 0 where masked
    block_lse = row_max.squeeze(-1) + torch.log(probs.sum(-1))
    new_lse = torch.logaddexp(lse, block_lse)
    # O_b * exp(lse_b - lse) = (P V / sum P) * sum P * exp(m - lse) = (P V) * exp(m - lse): no 0/0 for empty rows.
    weighted = torch.einsum("bhgqk,bhkd->bhgqd", probs, v) * torch.exp(row_max - new_lse[..., None])
    return out * torch.exp(lse - new_lse)[..., None] + weighted, new_lse


def _block_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_grad: torch.Tensor,
    delta: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    allowed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient contributions of one key/value block: ``(dQ part, dK_b, dV_b)``."""
    probs = torch.exp(_scores(q, k, scale, allowed) - lse[..., None])
    value_grad = torch.einsum("bhgqk,bhgqd->bhkd", probs, out_grad)
    score_grad = probs * (torch.einsum("bhgqd,bhkd->bhgqk", out_grad, v) - delta[..., None])
    query_grad = torch.einsum("bhgqk,bhkd->bhgqd", score_grad, k) * scale
    key_grad = torch.einsum("bhgqk,bhgqd->bhkd", score_grad, q) * scale
    return query_grad, key_grad, value_grad


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs; float64 stays float64."""
    return torch.promote_types(tensor.dtype, torch.float32)


class _Ring:
    """Neighbours of this rank in ``group`` and the one operation a ring needs: pass tensors on."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: datetime.timedelta) -> None:
        self.group = group
        self.timeout = timeout
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if group is not None and self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start_shift(self, tensors: list[torch.Tensor], tag: int = 0) -> tuple[list[torch.Tensor], list[Any]]:
        """Send ``tensors`` to the next rank and receive the previous rank's; returns the receive buffers
        and the pending operations (wait with :meth:`finish`). Shifts in flight at the same time need
        different tags (gloo matches messages by peer and tag)."""
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.previous, self.group, tag) for r in received]
        return received, dist.batch_isend_irecv(ops)

    def finish(self, works: list[Any]) -> None:
        for work in works:
            work.wait(timeout=self.timeout)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on all ranks), in group-rank order."""
        if self.size == 1:
            return [tensor]
        gathered = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(gathered, tensor.contiguous(), group=self.group)
        return gathered


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, token_index, sample_ids, scale, group, timeout):
        ring = _Ring(group, timeout)
        indices, samples = ring.all_gather(token_index), ring.all_gather(sample_ids)
        compute = _compute_dtype(query)
        q = _group_heads(query.to(compute), key.shape[1])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        blocks = [key, value]
        for step in range(ring.size):
            pending = ring.start_shift(blocks) if step < ring.size - 1 else None
            source = (ring.rank - step) % ring.size
            allowed = attention_allowed(token_index, sample_ids, indices[source], samples[source])
            if bool(allowed.any()):  # with contiguous chunks, blocks from later ranks are all in the future
                out, lse = _merge_block(out, lse, q, blocks[0].to(compute), blocks[1].to(compute), scale, allowed)
            if pending is not None:
                blocks, works = pending
                ring.finish(works)
        ctx.save_for_backward(query, key, value, out, lse, token_index, sample_ids, *indices, *samples)
        ctx.scale, ctx.ring = scale, ring
        return out.reshape(query.shape).to(query.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, out, lse, token_index, sample_ids, *labels = ctx.saved_tensors
        ring: _Ring = ctx.ring
        indices, samples = labels[: ring.size], labels[ring.size :]
        compute = _compute_dtype(query)
        q = _group_heads(query.to(compute), key.shape[1])
        out_grad = _group_heads(grad_output.to(compute), key.shape[1])
        delta = (out_grad * out).sum(-1)
        query_grad = torch.zeros_like(q)
        blocks = [key, value]
        block_grads = [torch.zeros(key.shape, dtype=compute, device=key.device) for _ in range(2)]
        for step in range(ring.size):
            pending = ring.start_shift(blocks) if step < ring.size - 1 else None
            source = (ring.rank - step) % ring.size
            allowed = attention_allowed(token_index, sample_ids, indices[source], samples[source])
            if bool(allowed.any()):
                dq, dk, dv = _block_grads(
                    q, blocks[0].to(compute), blocks[1].to(compute), out_grad, delta, lse, ctx.scale, allowed
                )
                query_grad += dq
                block_grads = [block_grads[0] + dk, block_grads[1] + dv]
            if ring.size > 1:  # the gradients follow their block; the last hop brings them home
                block_grads, works = ring.start_shift(block_grads, tag=1)
                ring.finish(works)
            if pending is not None:
                blocks, works = pending
                ring.finish(works)
        key_grad, value_grad = block_grads
        return (
            query_grad.reshape(query.shape).to(query.dtype),
            key_grad.to(key.dtype),
            value_grad.to(value.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    token_index: torch.Tensor,
    sample_ids: torch.Tensor,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the keys and values of all ranks of ``group``.

    ``query`` is ``[B, Hq, S, D]``, ``key`` and ``value`` ``[B, Hkv, S, D]`` (``Hq`` a multiple of
    ``Hkv``); ``token_index`` and ``sample_ids`` are ``[B, S]`` integer labels of the local tokens: their
    index in the whole row and their packed sample. Every rank passes the same ``B`` and ``S``. Returns
    ``[B, Hq, S, D]`` in the query's dtype. ``scale`` defaults to ``D ** -0.5``. Without a group (or
    with a one-rank group) this is plain masked attention over the local tokens. Every rank of the
    group must call it, in the same order; each transfer waits at most ``timeout``.
    """
    if query.dim() != 4 or key.shape != value.shape or key.shape[::2] != query.shape[::2]:
        raise ValueError(
            f"ring_attention wants query [B, Hq, S, D] and key/value [B, Hkv, S, D], "
            f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    expected = (query.shape[0], query.shape[2])
    if tuple(token_index.shape) != expected or tuple(sample_ids.shape) != expected:
        raise ValueError(
            f"token_index {tuple(token_index.shape)} and sample_ids {tuple(sample_ids.shape)} "
            f"must be [B, S] = {expected}"
        )
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(query, key, value, token_index, sample_ids, scale, group, timeout)
