"""``raylign estimate-memory``: the parameter count of a shape, the per-rank arithmetic of each layout
on a hand-computed case, and the estimate against the measured peak of real training steps."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from raylign.cli.main import main
from raylign.engine.memory import KNOWN_SHAPES, Layout, ModelShape, estimate_training_memory
from raylign.models.tiny import build_tiny_model

PROBE = Path(__file__).with_name("memory_probe.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch, tied", [("qwen2", True), ("qwen2", False), ("llama", True)])
def test_the_shape_counts_the_parameters_the_model_has(tmp_path, arch, tied):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(tmp_path / "m", arch=arch, hidden_size=64, num_layers=3, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert ModelShape.from_config(model.config).params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("qwen3", {}),  # q_norm and k_norm: head_dim weights each, in every layer
        ("qwen3", {"attention_bias": True}),  # biases on q, k, v and the output projection
        ("llama", {"attention_bias": True}),
        ("llama", {"mlp_bias": True}),  # biases on gate, up and down
    ],
)
def test_the_shape_counts_norms_and_biases_beyond_qwen2s(arch, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=100)
    config = AutoConfig.for_model(arch, num_key_value_heads=2, head_dim=24, **sizes, **extra)
    model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_config(config).params() == sum(p.numel() for p in model.parameters())


def test_the_known_sizes_are_the_models_they_name():
    # Parameter counts of the Qwen2.5 models, as their model cards give them.
    expected = {"0.5b": 494_032_768, "1.5b": 1_543_714_304, "7b": 7_615_616_512, "32b": 32_763_876_352}
    assert {name: shape.params() for name, shape in KNOWN_SHAPES.items()} == expected


def test_each_layout_divides_what_it_shards():
    # A shape small enough to count by hand: H 8, 2 layers, 2 heads of 4, 1 KV head, I 16, V 32, untied.
    shape = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=32)
    # Per layer: q 8x8, k and v 8x4, o 8x8, MLP 3 x 8x16 = 64+64+64+384 = 576 split; norms 16.
    # Embedding and head 2 x 32x8 = 512; final norm 8. Total 2 x 592 + 512 + 8 = 1704.
    assert shape.layer_params() == (576, 16) and shape.params() == 1704
    local = estimate_training_memory(shape, Layout(dtype="float32", backend="local", micro_batch_tokens=10))
    assert local.device["weights"] == 1704 * 4 and local.device["gradients"] == 1704 * 4
    assert local.device["optimizer"] == 1704 * 8
    # Activations: 10 tokens x 2 layers x (8H + 4K + 4I) = 10 x 2 x (64 + 16 + 64) fp32 values.
    assert local.device["activations"] == 10 * 2 * 144 * 4
    assert local.device["logits"] == 10 * 32 * 4 * 3.5
    # fsdp2 over 4 ranks with tensor parallel 2: the split matrices halve, then everything shards over 2.
    layout = Layout(dtype="bfloat16", backend="fsdp2", ranks=4, tensor_parallel=2, micro_batch_tokens=10)
    tp = estimate_training_memory(shape, layout)
    per_rank = 2 * (576 / 2 + 16) + 512 / 2 + 8  # 872 parameters, over 2 data-parallel ranks
    assert tp.device["weights"] == per_rank / 2 * 4 and tp.device["optimizer"] == per_rank / 2 * 8  # fp32 masters
    assert tp.device["gathered layers"] == 2 * (576 / 2 + 16) * 2 + 32 * 8 / 2 * 2
    # The norms' inputs 2H halve with the sequence, their outputs 2H stay whole (the projections keep them
    # gathered), the 4H + 4K + 4I inside attention and MLP halve.
    assert tp.device["activations"] == 10 * 2 * (16 / 2 + 16 + 112 / 2) * 2
    whole = estimate_training_memory(shape, dataclasses.replace(layout, shard_activations=False))
    assert whole.device["activations"] == 10 * 2 * (32 + 112 / 2) * 2  # 4H whole on every rank
    # ZeRO-2: whole bf16 weights, sharded gradients, optimizer and fp32 masters; offloading moves the latter.
    zero2 = estimate_training_memory(
        shape, Layout(backend="deepspeed", zero_stage=2, ranks=4, offload_optimizer=True, micro_batch_tokens=10)
    )
    assert zero2.device["weights"] == 1704 * 2 and zero2.device["gradients"] == 1704 / 4 * 2
    assert zero2.host == {"optimizer": 1704 / 4 * 8, "master weights": 1704 / 4 * 8}


@pytest.mark.slow
@pytest.mark.parametrize("tokens, checkpointing", [(256, False), (512, True)])
def test_the_estimate_is_within_a_fifth_of_the_measured_peak(tokens, checkpointing):
    """SmolLM2-135M, fp32, the local engine on the CPU: the peak resident memory of a training step."""
    from transformers import AutoConfig

    from raylign.models import ensure_smollm2

    folder = ensure_smollm2()
    command = [sys.executable, str(PROBE), str(folder), str(tokens)] + (["--checkpointing"] if checkpointing else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]
    shape = ModelShape.from_config(AutoConfig.from_pretrained(str(folder)))
    layout = Layout(dtype="float32", backend="local", micro_batch_tokens=tokens, gradient_checkpointing=checkpointing)
    estimated = estimate_training_memory(shape, layout).total
    # Measured on this machine (2026-12-02): within 6% for 256-2048 tokens, with and without checkpointing.
    figures = f"estimated {estimated / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB"
    print(f"{tokens} tokens, checkpointing {checkpointing}: {figures}")
    assert 0.8 <= estimated / measured <= 1.2, figures


def test_the_command_prints_the_table_and_a_breakdown(capsys):
    assert main(["estimate-memory", "--table", "true"]) == 0
    table = capsys.readouterr().out
    assert "| fsdp2, 8 ranks |" in table and "7b (7.62B)" in table
    assert main(["estimate-memory", "--model", "0.5b", "--backend", "local", "--num_processes", "1"]) == 0
    out = capsys.readouterr().out
    assert "0.5b: 494M parameters, bfloat16, local, 1 rank(s)" in out and "total" in out
