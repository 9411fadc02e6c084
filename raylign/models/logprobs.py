"""Per-token log-probabilities and entropies of causal language models.

Everything here works on padded batches (``attention_mask``) and on packed batches (several
samples per row, ``position_ids`` restarting at 0, no ``attention_mask``); see
:mod:`raylign.models.packing` for how samples are kept apart.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Literal, overload

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from raylign.models.packing import attention_kwargs, has_predecessor_mask

# Logit rows turned into float32 at a time: bounds the extra memory to about
# DEFAULT_CHUNK_ROWS x vocab floats instead of a full [B, T, V] float32 copy.
DEFAULT_CHUNK_ROWS = 1024


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _as_batch_seq(x: torch.Tensor, trailing: int) -> torch.Tensor:
    """View ``x`` as ``[N, S, *trailing dims]`` without copying a ``[B, S, ...]`` slice such as ``logits[:, :-1]``."""
    leading = x.shape[: x.dim() - trailing]
    if len(leading) >= 2:
        return x.reshape(-1, *x.shape[-1 - trailing :])
    return x.reshape(1, -1, *x.shape[x.dim() - trailing :])


def _scaled_chunks(logits: torch.Tensor, temperature: float, chunk_rows: int):
    """Yield ``(window, chunk)``: ``[N, s, V]`` slices along the sequence in float32 (float64 stays float64),
    divided by ``temperature``."""
    seq = _as_batch_seq(logits, trailing=1)
    step = max(1, chunk_rows // max(1, seq.shape[0]))
    for start in range(0, seq.shape[1], step):
        window = slice(start, start + step)
        chunk = seq[:, window].to(torch.promote_types(seq.dtype, torch.float32))
        yield window, (chunk / temperature if temperature != 1.0 else chunk)


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """log p(label) under softmax(logits / temperature), in float32 (float64 for float64 logits), shape
    ``labels.shape``.

    log softmax(z)_y = z_y - logsumexp(z), evaluated in chunks along the sequence so that no
    full log-softmax tensor (and no full float32 copy of bf16 logits) is materialised, forward or
    backward (see :class:`_ChunkedLogprobs`). ``logits`` is ``[..., V]`` and ``labels`` the matching
    ``[...]`` integer tensor.
    """
    _check_logits_and_labels(logits, labels, temperature)
    logprobs, _ = _ChunkedLogprobs.apply(logits, labels, temperature, chunk_rows, False)
    return logprobs


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs_from_logits` (differentiable) and the entropy of each predictive distribution
    (without a graph: a statistic), from one pass over each chunk of logits.

    With ``s = z - max(z)``, ``S = sum_i exp(s_i)``: ``H = log S - sum_i exp(s_i) s_i / S``, the
    entropy of :func:`entropy_from_logits` (equal to float32 rounding) from the ``exp(s)`` that
    ``logsumexp(z) = max(z) + log S`` computes anyway.
    """
    _check_logits_and_labels(logits, labels, temperature)
    return _ChunkedLogprobs.apply(logits, labels, temperature, chunk_rows, True)


def _check_logits_and_labels(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> None:
    _check_temperature(temperature)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")


class _ChunkedLogprobs(torch.autograd.Function):
    """``z_y - logsumexp(z)`` of ``z = logits / temperature`` chunk by chunk, with a backward pass of its own.

    Left to autograd, the chunked forward keeps a float32 copy of every chunk for the backward pass, and
    the backward assembles the logits' gradient from several tensors of their full size (the log-sum-exp's
    ``exp``, the gather's zero-filled scatter, their sum, a zero-filled gradient of the whole input per
    chunk). Here the backward recomputes each chunk's softmax from the saved logits and writes
    ``d/dz = g (onehot(y) - exp(z - logsumexp(z))) / temperature`` into one tensor of the logits' dtype:
    the same float32 operations on the same values as autograd's, less memory and fewer passes.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk_rows: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq_labels = _as_batch_seq(labels, trailing=0)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logsumexp = torch.empty(seq_labels.shape, dtype=dtype, device=logits.device)
        logprobs = torch.empty_like(logsumexp)
        entropy = torch.empty_like(logsumexp) if with_entropy else None
        for window, chunk in _scaled_chunks(logits, temperature, chunk_rows):
            # torch.logsumexp's own steps: max(z) + log(sum(exp(z - max))), an infinite max taken as 0
            top = chunk.amax(dim=-1, keepdim=True)
            top.masked_fill_(top.abs() == math.inf, 0)
            shifted = chunk - top
            exp = shifted.exp() if with_entropy else shifted.exp_()
            total = exp.sum(dim=-1)
            log_total = total.log()
            logsumexp[:, window] = log_total + top.squeeze(-1)
            picked = chunk.gather(-1, seq_labels[:, window].unsqueeze(-1)).squeeze(-1)
            logprobs[:, window] = picked - logsumexp[:, window]
            if entropy is not None:
                # A masked logit (-inf) has exp 0 and adds nothing; clamped so that 0 * -inf is not NaN.
                finite = shifted.clamp_(min=torch.finfo(dtype).min)
                entropy[:, window] = log_total - (exp * finite).sum(dim=-1) / total
        ctx.save_for_backward(logits, labels, logsumexp)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        if entropy is not None:
            entropy = entropy.reshape(labels.shape)
            ctx.mark_non_differentiable(entropy)
        return logprobs.reshape(labels.shape), entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logprobs: torch.Tensor, _grad_entropy: Any) -> tuple[torch.Tensor | None, ...]:
        logits, labels, logsumexp = ctx.saved_tensors
        seq_labels = _as_batch_seq(labels, trailing=0)
        grad_seq = _as_batch_seq(grad_logprobs, trailing=0)
        grad = torch.empty(_as_batch_seq(logits, trailing=1).shape, dtype=logits.dtype, device=logits.device)
        for window, chunk in _scaled_chunks(logits, ctx.temperature, ctx.chunk_rows):
            g = grad_seq[:, window].unsqueeze(-1)
            # -g exp(z - logsumexp) from the log-sum-exp, then + g at the label from the gather
            chunk_grad = (chunk - logsumexp[:, window].unsqueeze(-1)).exp_().mul_(-g)
            chunk_grad.scatter_add_(-1, seq_labels[:, window].unsqueeze(-1), g)
            grad[:, window] = chunk_grad.div_(ctx.temperature) if ctx.temperature != 1.0 else chunk_grad
        return grad.reshape(logits.shape), None, None, None, None


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> torch.Tensor:
    """Token entropy of softmax(logits / temperature) over the last dim, in float32 (float64 for float64
    logits), shape ``logits.shape[:-1]``.

    H = -sum_i p_i log p_i = logsumexp(z) - sum_i p_i z_i, computed in chunks along the sequence, with z
    shifted by its (detached) maximum: H does not change, and both terms stay small, so large logits do
    not cancel to float32 rounding error.
    """
    _check_temperature(temperature)
    pieces = [
        _entropy(chunk - chunk.amax(dim=-1, keepdim=True).detach())
        for _, chunk in _scaled_chunks(logits, temperature, chunk_rows)
    ]
    if not pieces:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(pieces, dim=1).reshape(logits.shape[:-1])


def _entropy(shifted: torch.Tensor) -> torch.Tensor:
    # A masked logit (-inf) has p = 0 and adds nothing; clamped to the dtype's lowest finite value so that
    # 0 * -inf does not make the sum NaN.
    finite = shifted.clamp(min=torch.finfo(shifted.dtype).min)
    return torch.logsumexp(shifted, dim=-1) - (torch.softmax(shifted, dim=-1) * finite).sum(-1)


def _align_to_inputs(next_token_values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Shift ``[B, T-1]`` values (prediction of token t+1) to ``[B, T]`` (indexed by token t), 0 where invalid."""
    aligned = nn.functional.pad(next_token_values, (1, 0))
    return torch.where(valid, aligned, torch.zeros_like(aligned))


@overload
def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = ...,
    position_ids: torch.Tensor | None = ...,
    temperature: float = ...,
    with_entropy: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = ...,
    position_ids: torch.Tensor | None = ...,
    temperature: float = ...,
    *,
    with_entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of ``input_ids`` under a causal LM, aligned to input positions.

    ``out[:, t] = log p(input_ids[:, t] | tokens of the same sample before t)``, float32 ``[B, T]``.
    Positions without a prediction are 0: t = 0, padding, the first token after left padding and
    every packed sample start. With ``with_entropy`` also returns the entropy of the predictive
    distribution for token t, aligned and zeroed the same way.

    Padded batches pass ``attention_mask``; packed batches pass ``position_ids`` restarting at 0 at
    each sample start (attention never crosses samples).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    outputs = model(input_ids=input_ids, **attention_kwargs(attention_mask, position_ids))
    logits = outputs.logits[:, :-1]
    valid = has_predecessor_mask(input_ids, attention_mask, position_ids)
    logprobs = _align_to_inputs(logprobs_from_logits(logits, input_ids[:, 1:], temperature), valid)
    if not with_entropy:
        return logprobs
    entropy = _align_to_inputs(entropy_from_logits(logits, temperature), valid)
    return logprobs, entropy


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    seq_starts: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed log-probabilities of the tokens ``loss_mask`` marks, one per sample, float32 ``[num samples]``.

    A padded batch holds one sample per row (pass ``attention_mask``); a packed batch holds sample
    ``i`` at flat positions ``seq_starts[i] ..`` (``seq_lens[i]`` tokens) of its ``[rows * L]``
    tokens (pass ``position_ids``, ``seq_starts`` and ``seq_lens``, as from
    :func:`raylign.data.collate_packed`). Used by the DPO family and KTO.
    """
    logprobs = token_logprobs(model, input_ids, attention_mask=attention_mask, position_ids=position_ids)
    scored = logprobs * loss_mask.to(logprobs.dtype)
    if seq_lens is None:
        return scored.sum(-1)
    if seq_starts is None:
        raise ValueError("a packed batch needs seq_starts with seq_lens")
    owner, positions = packed_token_positions(seq_starts.to(scored.device), seq_lens.to(scored.device))
    totals = torch.zeros(seq_lens.numel(), dtype=scored.dtype, device=scored.device)
    return totals.index_add(0, owner, scored.reshape(-1)[positions])


def packed_token_positions(seq_starts: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(owner, positions)``, each ``[sum of seq_lens]``: every token of every packed sample, sample by
    sample, as its sample index and its position in the flattened ``[rows * L]`` batch."""
    owner = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=seq_lens.device), seq_lens)
    first_of_owner = torch.repeat_interleave(seq_lens.cumsum(0) - seq_lens, seq_lens)
    within = torch.arange(owner.numel(), device=seq_lens.device) - first_of_owner
    return owner, seq_starts[owner] + within


@contextmanager
def logits_only_at(model: nn.Module, flat_positions: torch.Tensor):
    """Within the block the model's output layer sees only the hidden states at ``flat_positions``
    of the flattened ``[B * T]`` sequence, so the forward returns logits ``[1, N, V]``.

    The output layer is usually the largest matrix multiply per token and its float32 softmax
    the largest activation; positions nobody reads (prompts, padding) skip both. A forward
    pre-hook on the output embeddings keeps the model's own forward (and the FSDP2 / DeepSpeed
    hooks around it) untouched.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings to select logits from")

    def select(_module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1])[flat_positions].unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def selected_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    token_index: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    mask: torch.Tensor | None = None,
    entropy_grad: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of chosen tokens only, float32 with the shape of ``token_index``.

    ``token_index`` holds positions in the flattened ``[B * T]`` batch (each at least 1 past the
    start of its own sample); ``out[...] = log p(input_ids.flat[i] | its sample's tokens before i)``
    for ``i = token_index[...]``, computed from logits at ``i - 1`` alone (see
    :func:`logits_only_at`). Equals :func:`token_logprobs` read at those positions. With
    ``with_entropy`` also returns the entropy of each predictive distribution.

    ``mask`` (shaped like ``token_index``) marks the entries that are read: the output layer and
    the softmax run at those alone, so the padding of a ``[b, R]`` index of long-tailed responses
    costs nothing, and the other entries are 0. ``entropy_grad=False`` computes the entropy from
    detached logits without a graph (a statistic to log): no float32 tokens x vocabulary tensors
    are kept for the backward pass on its account.
    """
    _check_temperature(temperature)
    index = token_index.reshape(-1)
    keep = torch.ones_like(index, dtype=torch.bool) if mask is None else mask.reshape(-1).to(torch.bool)
    read = index[keep]
    # Nothing to read still runs one row: the result must depend on the output layer's weights, since
    # every data-parallel rank takes part in the backward pass.
    rows = read if read.numel() or index.numel() == 0 else index[:1]
    with logits_only_at(model, (rows - 1).clamp(min=0)):
        logits = model(input_ids=input_ids, **attention_kwargs(attention_mask, position_ids)).logits[0]
    labels = input_ids.reshape(-1)[rows]
    entropy: torch.Tensor | None = None
    if with_entropy and not entropy_grad:
        logprobs, entropy = logprobs_and_entropy_from_logits(logits, labels, temperature)
    else:
        logprobs = logprobs_from_logits(logits, labels, temperature)
        if with_entropy:
            entropy = entropy_from_logits(logits, temperature)
    logprobs = _place(keep, logprobs).reshape(token_index.shape)
    if entropy is None:
        return logprobs
    return logprobs, _place(keep, entropy).reshape(token_index.shape)


def _place(keep: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` at the ``True`` entries of ``keep`` in order, 0 elsewhere (differentiable in ``values``,
    which may hold more entries than ``keep`` selects: the surplus is dropped)."""
    return torch.zeros(keep.shape, dtype=values.dtype, device=values.device).masked_scatter(keep, values)
