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
    for mode in ("full", "sharded"):
        launch(model, tmp, mode, ranks=2)
    return model, tmp


def launch(model: Path, out: Path, mode: str, ranks: int, tensor_parallel: int = 1, lora_rank: int = 0) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    command += [str(WORKER), "--mode", mode, "--model-dir", str(model), "--out", str(out)]
    command += ["--tensor-parallel", str(tensor_parallel), "--lora-rank", str(lora_rank)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


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


def test_tensor_parallel_ranks_read_their_blocks_and_train_as_after_a_whole_load(tmp_path):
    """4 ranks, matrices split over pairs (tensor parallel 2) and FSDP2 shards over the pairs: every rank
    reads the block both splits leave it (nested shards of the same dimension included: the tied
    embedding and output head split over the vocabulary, then over FSDP2), and the weights and the first
    step equal those of the same layout loaded whole. Rows the ranks cannot split evenly (vocabulary 510,
    255 a pair, 128 and 127 a rank) are included."""
    model = build_tiny_model(
        tmp_path / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=130,
        vocab_size=510, tie_word_embeddings=True,
    )  # fmt: skip
    launch(model, tmp_path, "both", ranks=4, tensor_parallel=2)
    stored = load_file(model / "model.safetensors")
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(sharded) == set(full) == {*stored, "lm_head.weight"}  # the tied head is named in exports
    for name, weight in {**stored, "lm_head.weight": stored["model.embed_tokens.weight"]}.items():
        assert torch.equal(sharded[name], weight), name
        assert torch.equal(full[name], weight), name
    first, second = (json.loads((tmp_path / f"{mode}.json").read_text()) for mode in ("full", "sharded"))
    assert second["loss"] == first["loss"] and second["grad_norm"] == first["grad_norm"]
    stored_bytes = sum(w.numel() * w.element_size() for w in stored.values())
    assert max(rank["bytes_read"] for rank in json.loads((tmp_path / "sharded.json").read_text())["ranks"]) < (
        stored_bytes / 2
    )


def test_a_lora_model_reads_its_base_shard_by_shard_and_trains_as_after_a_whole_load(tmp_path):
    """LoRA adapters are not in the model's files: loaded shard by shard, every rank draws them whole as
    PEFT initialises them and keeps its block. The base weights equal the stored ones (B = 0: the merged
    model is the base), and one step gives the same loss, gradient norm and adapters as loading whole."""
    model = build_tiny_model(tmp_path / "model", hidden_size=64, vocab_size=512, tie_word_embeddings=True)
    launch(model, tmp_path, "both", ranks=2, lora_rank=4)
    stored = load_file(model / "model.safetensors")
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)
    for name, weight in stored.items():
        assert torch.equal(sharded[name], weight), name
    adapters = {mode: torch.load(tmp_path / f"{mode}_adapters.pt", weights_only=True) for mode in ("full", "sharded")}
    assert len(adapters["sharded"]) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert set(adapters["sharded"]) == set(adapters["full"])
    for name, weight in adapters["sharded"].items():
        assert torch.equal(weight, adapters["full"][name]), name
        if ".lora_B." in name:
            assert weight.abs().max() > 0, name  # the step moved it off its zeros
    first, second = (json.loads((tmp_path / f"{mode}.json").read_text()) for mode in ("full", "sharded"))
    assert second["loss"] == first["loss"] and second["grad_norm"] == first["grad_norm"]


def test_fresh_lora_adapters_are_drawn_as_peft_draws_them_from_the_seed_and_name(tmp_path):
    """lora_A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's Kaiming-uniform with a = sqrt(5)), the same for the
    same seed and name, another for another name; lora_B zeros. A model loaded whole carries exactly these."""
    from raylign.config.model import ModelConfig
    from raylign.models import load_causal_lm
    from raylign.models.loading import fresh_adapter_weight

    name = "base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight"
    torch.manual_seed(3)
    a, again, other = torch.empty(64, 4096), torch.empty(64, 4096), torch.empty(64, 4096)
    fresh_adapter_weight(name, a)
    fresh_adapter_weight(name, again)
    fresh_adapter_weight(name.replace("layers.0", "layers.1"), other)
    bound = 1 / 4096**0.5
    assert torch.equal(a, again) and not torch.equal(a, other)
    assert -bound <= a.min() < -0.99 * bound and 0.99 * bound < a.max() <= bound
    assert abs(a.std().item() - bound / 3**0.5) < 0.01 * bound  # a uniform's std: bound / sqrt(3)
    b = torch.ones(4096, 64)
    fresh_adapter_weight(name.replace("lora_A", "lora_B"), b)
    assert not b.any()
    # An embedding's adapter the other way round: A zeros, B standard normal.
    embedding = "base_model.model.model.embed_tokens.lora_embedding_{}.default"
    a, b = torch.ones(8, 512), torch.empty(4096, 8)
    fresh_adapter_weight(embedding.format("A"), a)
    fresh_adapter_weight(embedding.format("B"), b)
    assert not a.any() and abs(b.std().item() - 1) < 0.02 and abs(b.mean().item()) < 0.02

    path = build_tiny_model(tmp_path / "tiny", hidden_size=64)
    model = load_causal_lm(ModelConfig(path=str(path), dtype="float32", lora={"rank": 4}))
    for param_name, param in model.named_parameters():
        if ".lora_" in param_name:
            expected = torch.empty_like(param)
            fresh_adapter_weight(param_name, expected)
            assert torch.equal(param, expected), param_name


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


@pytest.mark.parametrize(
    ("engine", "lora_rank", "expected"),
    [
        ({"backend": "fsdp2"}, 0, True),
        ({"backend": "fsdp2", "num_processes": 4, "tensor_parallel_size": 2}, 0, True),
        ({"backend": "fsdp2", "load_sharded": False}, 0, False),
        ({"backend": "fsdp2"}, 8, True),  # the adapters, which the files lack, are drawn on every rank
        ({"backend": "deepspeed"}, 0, False),
        ({"backend": "local"}, 0, False),
    ],
)
def test_which_models_are_built_empty_for_the_engine_to_fill(engine, lora_rank, expected):
    from raylign.config.engine import EngineConfig
    from raylign.config.model import ModelConfig
    from raylign.models import loads_sharded

    model = ModelConfig(path="m", lora={"rank": lora_rank})
    assert loads_sharded(model, EngineConfig(**engine)) is expected
