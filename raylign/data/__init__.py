"""Data layer: reading dataset files, formatting and tokenising rows, mixing, sampling and batching.

It knows nothing about training: it turns files into lists of samples and samples into
tensors; trainers decide what to do with them.
"""

from raylign.data.chat import ALLOWED_ROLES, tokenize_conversation, validate_messages
from raylign.data.collate import balance_micro_batches, collate_packed, collate_padded, pack_rows
from raylign.data.errors import DataError, RowDropped, RowError, RowRef
from raylign.data.formatting import encode_plain, truncate_prompt_response
from raylign.data.mixing import mix_datasets, mixture_counts, split_holdout
from raylign.data.readers import SUPPORTED_SUFFIXES, read_rows
from raylign.data.rows import (
    DataStats,
    check_text,
    collect_samples,
    optional_text,
    refuse_system_beside_conversation,
    require_key,
    require_list,
    require_text,
)
from raylign.data.sampler import ResumableSampler, rank_micro_batches, shard_for_rank, split_micro_batches
from raylign.data.sft import Sample, SFTData, build_sft_datasets, load_sft_samples, make_sft_sample

__all__ = [
    "ALLOWED_ROLES",
    "SUPPORTED_SUFFIXES",
    "DataError",
    "DataStats",
    "ResumableSampler",
    "RowDropped",
    "RowError",
    "RowRef",
    "SFTData",
    "Sample",
    "balance_micro_batches",
    "build_sft_datasets",
    "check_text",
    "collate_packed",
    "collate_padded",
    "collect_samples",
    "encode_plain",
    "load_sft_samples",
    "make_sft_sample",
    "mix_datasets",
    "mixture_counts",
    "optional_text",
    "refuse_system_beside_conversation",
    "pack_rows",
    "rank_micro_batches",
    "read_rows",
    "require_key",
    "require_list",
    "require_text",
    "shard_for_rank",
    "split_holdout",
    "split_micro_batches",
    "tokenize_conversation",
    "truncate_prompt_response",
    "validate_messages",
]
