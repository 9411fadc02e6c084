"""Per-token log-probabilities and entropies of causal language models.

Everything here works on padded batches (``attention_mask``) and on packed batches (several
samples per row, ``position_ids`` restarting at 0, no ``attention_mask``); see
:mod:`raylign.models.packing` for how samples are kept apart.
"""

from __future__ import annotations

import torch
from torch import nn

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
    """Yield ``(window, chunk)``: float32 ``[N, s, V]`` slices along the sequence, divided by ``temperature``."""
    seq = _as_batch_seq(logits, trailing=1)
    step = max(1, chunk_rows // max(1, seq.shape[0]))
    for start in range(0, seq.shape[1], step):
        window = slice(start, start + step)
        chunk = seq[:, window].float()
        yield window, (chunk / temperature if temperature != 1.0 else chunk)


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """log p(label) under softmax(logits / temperature), in float32, shape ``labels.shape``.

    log softmax(z)_y = z_y - logsumexp(z), evaluated in chunks along the sequence so that no
    full log-softmax tensor (and no full float32 copy of bf16 logits) is materialised.
    ``logits`` is ``[..., V]`` and ``labels`` the matching ``[...]`` integer tensor.
    """
    _check_temperature(temperature)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    seq_labels = _as_batch_seq(labels, trailing=0)
    pieces = [
        chunk.gather(-1, seq_labels[:, window].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(chunk, dim=-1)
        for window, chunk in _scaled_chunks(logits, temperature, chunk_rows)
    ]
    if not pieces:
        return torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(pieces, dim=1).reshape(labels.shape)


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the last dim, in float32, shape ``logits.shape[:-1]``.

    H = -sum_i p_i log p_i = logsumexp(z) - sum_i p_i z_i, computed in chunks along the sequence.
    """
    _check_temperature(temperature)
    pieces = [
        torch.logsumexp(chunk, dim=-1) - (torch.softmax(chunk, dim=-1) * chunk).sum(-1)
        for _, chunk in _scaled_chunks(logits, temperature, chunk_rows)
    ]
    if not pieces:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(pieces, dim=1).reshape(logits.shape[:-1])


def _align_to_inputs(next_token_values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Shift ``[B, T-1]`` values (prediction of token t+1) to ``[B, T]`` (indexed by token t), 0 where invalid."""
    aligned = nn.functional.pad(next_token_values, (1, 0))
    return torch.where(valid, aligned, torch.zeros_like(aligned))


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
