"""Models and tokenizers: local loading, the shipped SmolLM2, score heads, LoRA, per-token log-probs."""

from raylign.models.heads import last_token_indices, load_score_model, sequence_scores, token_scores
from raylign.models.loading import load_causal_lm, load_tokenizer, loads_sharded, resolve_model_path, torch_dtype
from raylign.models.logprobs import (
    entropy_from_logits,
    logits_only_at,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
    selected_token_logprobs,
    sequence_logprobs,
    token_logprobs,
)
from raylign.models.packing import attention_kwargs, has_packed_samples, positions_from_attention_mask
from raylign.models.smollm2 import SMOLLM2_NAME, MissingPackageError, ensure_smollm2, find_smollm2_gguf

__all__ = [
    "SMOLLM2_NAME",
    "MissingPackageError",
    "attention_kwargs",
    "ensure_smollm2",
    "entropy_from_logits",
    "find_smollm2_gguf",
    "has_packed_samples",
    "last_token_indices",
    "load_causal_lm",
    "loads_sharded",
    "load_score_model",
    "load_tokenizer",
    "logits_only_at",
    "logprobs_and_entropy_from_logits",
    "logprobs_from_logits",
    "positions_from_attention_mask",
    "resolve_model_path",
    "sequence_scores",
    "selected_token_logprobs",
    "sequence_logprobs",
    "token_logprobs",
    "token_scores",
    "torch_dtype",
]
