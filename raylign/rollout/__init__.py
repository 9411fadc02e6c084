"""Rollout: generation engines behind one async interface, and trainer -> engine weight sync."""

from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.rollout.base import Completion, RolloutEngine
from raylign.rollout.buckets import Bucket, TensorMeta, group_into_buckets, pack_bucket, unpack_bucket
from raylign.rollout.hf_engine import HFEngine
from raylign.rollout.pool import RolloutPool, engine_class, launch_engines, split_by_token_load
from raylign.rollout.vllm_engine import VLLMEngine
from raylign.rollout.weight_sync import SyncStats, WeightSyncSender, with_tied_lm_head

__all__ = [
    "Bucket",
    "Completion",
    "HFEngine",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutPool",
    "SamplingConfig",
    "SyncStats",
    "TensorMeta",
    "VLLMEngine",
    "WeightSyncSender",
    "engine_class",
    "group_into_buckets",
    "launch_engines",
    "pack_bucket",
    "split_by_token_load",
    "unpack_bucket",
    "with_tied_lm_head",
]
