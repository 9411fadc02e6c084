"""Shared fixtures of the data-layer tests: the tiny tokenizer, a tiny model and dataset writers."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import torch

from raylign.models.tiny import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def newline_merging_tokenizer():
    """Byte tokens plus one merge, of two newlines into one token (Qwen's tokenizers merge them too), and
    ChatML without generation markers: a reply that starts with a newline merges with the newline ending
    the assistant header, so the rendered conversation no longer starts with the rendered prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["ĊĊ"] = len(vocab)  # byte-level "\n\n"
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "Ċ")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|pad|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert tokenizer.tokenize("a\n\nb") == ["a", "ĊĊ", "b"]
    return tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), hidden_size=32, num_layers=2)


def write_rows(path: Path, rows: list[dict[str, Any]], fmt: str) -> Path:
    """Write ``rows`` to ``path`` (suffix added) in ``fmt`` with the format's usual library writer."""
    if fmt == "jsonl":
        out = path.with_suffix(".jsonl")
        out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif fmt == "json":
        out = path.with_suffix(".json")
        out.write_text(json.dumps(rows, indent=1))
    elif fmt == "parquet":
        out = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(rows), out)
    elif fmt == "csv":
        out = path.with_suffix(".csv")
        pa_csv.write_csv(pa.Table.from_pylist(rows), out)
    elif fmt in ("arrow", "feather"):
        out = path.with_suffix("." + fmt)
        feather.write_feather(pa.Table.from_pylist(rows), out)
    elif fmt == "datasets":
        import datasets

        out = path.with_suffix("")
        datasets.Dataset.from_list(rows).save_to_disk(str(out))
    else:
        raise ValueError(fmt)
    return out


@pytest.fixture
def write_dataset(tmp_path) -> Callable[..., Path]:
    """``write_dataset(rows, fmt='jsonl', name='data')`` writes a dataset under tmp_path and returns its path."""

    def write(rows: list[dict[str, Any]], fmt: str = "jsonl", name: str = "data") -> Path:
        return write_rows(tmp_path / name, rows, fmt)

    return write
