"""FSDP2 loading shard by shard (``engine.load_sharded``): 2 ranks, against loading the whole model.

The model (8 layers of width 512 and an untied head over the tokenizer's vocabulary, about 34M
parameters) is stored in bf16 and trained in fp32, so loading it whole costs every rank the fp32
model (about 137 MB) before sharding. Loaded shard by shard, a rank holds its fp32 half of every
weight plus, briefly, the rows it is reading of one weight: at most half the model plus half the
largest weight.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raylign.models.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("load_sharded_worker.py")
SLACK = 24 << 20  # modules imported and allocator pages beside the weights

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("load_sharded")
    model = build_tiny_model(
        tmp / "model", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536,
        vocab_size=32000, tie_word_embeddings=False, dtype=torch.bfloat16,  # the tokenizer learns ~8.9k
    )  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    for mode in ("full", "sharded"):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER)]
        command += ["--mode", mode, "--model-dir", str(model), "--out", str(tmp)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return model, tmp


def test_sharded_load_gives_the_stored_weights_and_the_same_first_step(runs):
    model, out = runs
    stored = load_file(model / "model.safetensors")
    sharded = torch.load(out / "sharded.pt", weights_only=True)
    full = torch.load(out / "full.pt", weights_only=True)
    assert set(sharded) == set(stored) == set(full)
    for name, weight in stored.items():
        assert torch.equal(sharded[name], weight.float()), name
        assert torch.equal(sharded[name], full[name]), name
    first, second = (json.loads((out / f"{mode}.json").read_text()) for mode in ("full", "sharded"))
    assert second["loss"] == first["loss"] and second["grad_norm"] == first["grad_norm"]


def test_no_rank_holds_the_whole_model_and_each_reads_only_its_half(runs):
    model, out = runs
    stored = load_file(model / "model.safetensors")
    fp32_bytes = sum(w.numel() * 4 for w in stored.values())
    largest = max(w.numel() * 4 for w in stored.values())
    stored_bytes = sum(w.numel() * w.element_size() for w in stored.values())
    full = json.loads((out / "full.json").read_text())["ranks"]
    sharded = json.loads((out / "sharded.json").read_text())["ranks"]
    assert all(rank["rise"] >= fp32_bytes for rank in full), (full, fp32_bytes)  # the measurement sees a whole model
    for rank in sharded:
        assert rank["rise"] < fp32_bytes / 2 + largest / 2 + SLACK, (rank, fp32_bytes, largest)
    # Every row of every weight is read once, by one rank (each weight's rows split as torch.chunk splits them).
    assert sum(rank["bytes_read"] for rank in sharded) == stored_bytes
    assert max(rank["bytes_read"] for rank in sharded) <= stored_bytes / 2 + largest / 2


def test_a_folder_without_safetensors_is_named(tmp_path):
    from raylign.engine.fsdp2 import _weight_files

    with pytest.raises(FileNotFoundError, match=f"engine.load_sharded: {tmp_path} has neither model.safetensors"):
        _weight_files(tmp_path)


def test_an_empty_model_keeps_its_tied_output_layer_tied(tmp_path):
    """The output layer of a tied model is its embedding, one parameter: the shard read for it serves both."""
    from raylign.config.model import ModelConfig
    from raylign.models import load_causal_lm

    path = build_tiny_model(tmp_path / "tied", hidden_size=64, tie_word_embeddings=True)
    model = load_causal_lm(ModelConfig(path=str(path), dtype="float32"), empty=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.is_meta
    assert "lm_head.weight" not in dict(model.named_parameters())
