"""Rollout: generation engines behind one async interface, and trainer -> engine weight sync.

Names are imported on first use: reward-function worker processes import
``raylign.rollout.rewards`` and must not pay for torch, vLLM and the engines at start-up.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RolloutConfig": "raylign.config.rollout",
    "SamplingConfig": "raylign.config.rollout",
    "Completion": "raylign.rollout.base",
    "RolloutEngine": "raylign.rollout.base",
    "Bucket": "raylign.rollout.buckets",
    "TensorMeta": "raylign.rollout.buckets",
    "group_into_buckets": "raylign.rollout.buckets",
    "pack_bucket": "raylign.rollout.buckets",
    "unpack_bucket": "raylign.rollout.buckets",
    "HFEngine": "raylign.rollout.hf_engine",
    "RolloutPool": "raylign.rollout.pool",
    "engine_class": "raylign.rollout.pool",
    "launch_engines": "raylign.rollout.pool",
    "split_by_token_load": "raylign.rollout.pool",
    "VLLMEngine": "raylign.rollout.vllm_engine",
    "SyncStats": "raylign.rollout.weight_sync",
    "WeightSyncSender": "raylign.rollout.weight_sync",
    "with_tied_lm_head": "raylign.rollout.weight_sync",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raylign.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
