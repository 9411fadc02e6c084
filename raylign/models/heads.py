"""Score models on a language-model backbone: reward models, process reward models, critics.

A score model is Hugging Face's ``AutoModelForSequenceClassification`` for the backbone (a
linear ``score`` head on the final hidden states), so a trained reward model saves and loads as
an ordinary Hugging Face folder. The same head read at every position gives critic values
(``num_labels=1``) or per-step PRM logits (``num_labels>1``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification

from raylign.config.model import ModelConfig
from raylign.models.loading import (
    apply_training_options,
    build_empty,
    from_pretrained_kwargs,
    load_tokenizer,
    resolve_model_path,
)
from raylign.models.packed_attention import keep_samples_apart
from raylign.models.packing import attention_kwargs

logger = logging.getLogger(__name__)

HEAD_NAME = "score"


def init_score_head(head: nn.Linear) -> None:
    """Fresh head weights ~ Normal(mean 0, std 1 / sqrt(hidden_size + 1)), bias 0.

    With unit-scale final hidden states this starts scores at about unit variance, as in
    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (reward head init).
    Drawn from a generator seeded with the process's seed (``torch.initial_seed()``), so a model
    loaded whole and one loaded shard by shard (:func:`fresh_head_weight`) start from the same head.
    """
    with torch.no_grad():
        fresh_head_weight(head.weight)
        if head.bias is not None:
            head.bias.zero_()


def fresh_head_weight(weight: torch.Tensor) -> None:
    """Fill a whole head weight ``[labels, hidden]`` as :func:`init_score_head` does."""
    generator = torch.Generator().manual_seed(torch.initial_seed())
    values = torch.empty(weight.shape, dtype=torch.float32).normal_(
        0.0, 1.0 / math.sqrt(weight.shape[-1] + 1), generator=generator
    )
    weight.copy_(values.to(weight.device))


def _split_missing_keys(missing: list[str] | set[str]) -> tuple[list[str], list[str]]:
    head = sorted(k for k in missing if k.startswith(HEAD_NAME + "."))
    backbone = sorted(k for k in missing if not k.startswith(HEAD_NAME + "."))
    return head, backbone


def load_score_model(
    cfg: ModelConfig,
    num_labels: int = 1,
    init_from_causal_lm: bool = True,
    device: torch.device | str | None = None,
    empty: bool = False,
) -> nn.Module:
    """Load a score model (``AutoModelForSequenceClassification``) for ``cfg``.

    With ``init_from_causal_lm`` the folder may hold a plain causal LM: its backbone weights are
    loaded and a fresh ``score`` head of ``num_labels`` outputs is initialised with
    :func:`init_score_head`. A folder that already holds a score head (a saved reward model) keeps
    it. With ``init_from_causal_lm=False`` the head must be in the folder. ``config.pad_token_id``
    is set from the tokenizer. Gradient checkpointing and LoRA follow ``cfg`` (with LoRA the
    head stays fully trainable).

    ``empty``: the parameters are left on the meta device for an engine that reads each rank's shard
    from the folder (:func:`raylign.engine.fsdp2.load_sharded_weights`); a head the folder lacks is
    then listed in ``model.fresh_weights`` with the function that initialises it whole.
    """
    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    folder = resolve_model_path(cfg.path)
    tokenizer = load_tokenizer(cfg.tokenizer_path or folder)
    if empty:
        return _empty_score_model(cfg, folder, num_labels, init_from_causal_lm, tokenizer.pad_token_id)
    model, info = AutoModelForSequenceClassification.from_pretrained(
        folder, num_labels=num_labels, output_loading_info=True, **from_pretrained_kwargs(cfg)
    )
    keep_samples_apart(model)
    head = getattr(model, HEAD_NAME, None)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"'{cfg.path}': {type(model).__name__} has no linear '{HEAD_NAME}' head; score models support "
            "decoder architectures whose sequence-classification class ends in one (Llama, Qwen2, Mistral, ...)"
        )
    missing_head, missing_backbone = _split_missing_keys(info["missing_keys"])
    if missing_backbone:
        raise ValueError(
            f"'{cfg.path}' lacks backbone weights for {type(model).__name__}: {missing_backbone[:5]}"
            f"{' ...' if len(missing_backbone) > 5 else ''}"
        )
    if missing_head and not init_from_causal_lm:
        raise ValueError(
            f"'{cfg.path}' holds no '{HEAD_NAME}' head (a causal LM?); expected a saved score model, "
            "or pass init_from_causal_lm=True to start a fresh head on this backbone"
        )
    if missing_head:
        init_score_head(head)
    elif init_from_causal_lm:
        logger.info("'%s' already holds a score head; keeping it", cfg.path)
    model.config.pad_token_id = tokenizer.pad_token_id
    if device is not None:
        model.to(device)
    return apply_training_options(model, cfg, task_type="SEQ_CLS")


def _empty_score_model(
    cfg: ModelConfig, folder: Path, num_labels: int, init_from_causal_lm: bool, pad_token_id: int | None
) -> nn.Module:
    """:func:`load_score_model` on the meta device: the weights' names are checked against the folder's
    files now; their values are read later, shard by shard."""
    model = build_empty(AutoModelForSequenceClassification, cfg, folder, num_labels=num_labels)
    model.config.pad_token_id = pad_token_id
    head = getattr(model, HEAD_NAME, None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"'{cfg.path}': {type(model).__name__} has no linear '{HEAD_NAME}' head")
    stored = stored_weight_names(folder)
    names = [name for name, _ in model.named_parameters()]
    missing_head, missing_backbone = _split_missing_keys(set(names) - stored)
    if missing_backbone:
        raise ValueError(f"'{cfg.path}' lacks backbone weights for {type(model).__name__}: {missing_backbone[:5]}")
    if missing_head and not init_from_causal_lm:
        raise ValueError(f"'{cfg.path}' holds no '{HEAD_NAME}' head (a causal LM?); expected a saved score model")

    def fresh_head(name: str, full: torch.Tensor) -> None:
        """The whole tensor ``name`` of a fresh head, as :func:`init_score_head` makes it: every rank draws
        the same values (the ranks share the process seed) and keeps its block."""
        if name.endswith("bias"):
            full.zero_()
        else:
            fresh_head_weight(full)

    model.fresh_weights = {name: fresh_head for name in missing_head}
    return apply_training_options(model, cfg, task_type="SEQ_CLS")


def stored_weight_names(folder: Path) -> set[str]:
    """The weight names the safetensors files of a model folder hold (read from the headers only)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names.update(handle.keys())
    return names


def _backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformer body and the score head of a score model, also inside a peft wrapper."""
    get_base = getattr(model, "get_base_model", None)  # a peft wrapper
    base = get_base() if callable(get_base) else model
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    head = getattr(base, HEAD_NAME, None)
    if backbone is None or head is None:
        raise TypeError(f"{type(base).__name__} is not a score model (no backbone and '{HEAD_NAME}' head)")
    return backbone, head


def _squeeze_single_label(scores: torch.Tensor) -> torch.Tensor:
    return scores.squeeze(-1) if scores.shape[-1] == 1 else scores


def token_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The score head at every position, float32: ``[B, T]`` for one label, ``[B, T, num_labels]`` otherwise.

    Position t scores the prefix ending at token t (critic value V(s_t), or PRM logits at a step
    end). Padding positions are 0. Accepts padded and packed batches like ``token_logprobs``.
    """
    _, head = _backbone_and_head(model)
    # Run the model's own forward and read the head's per-position output: FSDP2 gathers the
    # root's weights (embeddings, final norm, head) only inside the root forward, so calling the
    # backbone and the head separately would meet sharded weights.
    captured: dict[str, torch.Tensor] = {}
    handle = head.register_forward_hook(lambda _m, _i, out: captured.__setitem__("out", out))
    try:
        model(input_ids=input_ids, **attention_kwargs(attention_mask, position_ids))
    finally:
        handle.remove()
    scores = _squeeze_single_label(captured["out"].float())
    if attention_mask is None:
        return scores
    real = attention_mask.bool()
    if scores.dim() == 3:
        real = real.unsqueeze(-1)
    return torch.where(real, scores, torch.zeros_like(scores))


def last_token_indices(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the rightmost real token of each row (works for left and right padding)."""
    lengths = attention_mask.sum(-1)
    if bool((lengths == 0).any()):
        row = int((lengths == 0).nonzero()[0, 0])
        raise ValueError(f"row {row} of the batch has no real tokens (attention_mask is all 0)")
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.bool()).argmax(-1)


def sequence_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Score of each row at its last real token, float32 ``[B]`` (``[B, num_labels]`` for several labels).

    Equals Hugging Face's pooled ``model(...).logits`` for right-padded input, but finds the last
    token from ``attention_mask`` instead of comparing ids with ``pad_token_id`` (which is wrong
    when the pad token is the eos token that ends every sample).
    """
    last = last_token_indices(attention_mask)
    scores = token_scores(model, input_ids, attention_mask, position_ids)
    return scores[torch.arange(scores.shape[0], device=scores.device), last]
