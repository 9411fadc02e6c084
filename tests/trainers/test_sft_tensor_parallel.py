"""SFT with tensor parallelism: every attention and MLP matrix split over 2 or 4 gloo ranks (alone,
composed with fsdp2 as a 2 x 2 mesh, and with sequence parallel 2: each packed row's 2 chunks split over
2 ranks each) trains exactly like 4 data-parallel ranks holding whole layers;
so does hybrid sharding (HSDP: groups of ranks that shard, replicating each other), alone and beside
tensor parallel, tensor parallel with gradient checkpointing resumed from a checkpoint, and the
deepspeed backend's AutoTP (2, with ZeRO-1), alone and with sequence parallel 2 (ring and Ulysses).

Runs of the same data and seed on 4 ranks (``sft_tensor_parallel_worker.RUNS``). The loss and
gradient norm (clipped at 0.5, so the norm over every mesh matters) of every step and the exported
weights agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raylign.config.base import ConfigError, parse_config
from raylign.config.commands import SFTConfig
from raylign.models.tiny import build_tiny_model
from raylign.tasks.strings import make_string_rows
from raylign.trainers.metrics import read_metrics
from tests.spawned_ranks import import_worker, spawn_and_join

from .test_sft import write_jsonl

worker = import_worker(__file__, "sft_tensor_parallel_worker")


@pytest.mark.slow
@pytest.mark.distributed
def test_sft_with_matrices_split_over_ranks_trains_like_whole_layers(tmp_path):
    # Four key/value heads: four ranks can split them.
    model_dir = build_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4)
    train_file = write_jsonl(tmp_path / "train.jsonl", make_string_rows("reverse", 16, seed=0))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        args = (str(model_dir), str(train_file), str(tmp_path))
        spawn_and_join(worker.run_rank, args, worker.WORLD_SIZE, 900, "SFT ranks")
    runs = {n: [r for r in read_metrics(tmp_path / n) if "train/loss" in r] for n in worker.RUNS}
    weights = {n: load_file(tmp_path / n / "final" / "model.safetensors") for n in worker.RUNS}
    for baseline in set(worker.BASELINE.values()):
        assert [r["step"] for r in runs[baseline]] == list(range(1, worker.STEPS + 1))
        assert any(r["train/grad_norm"] > 0.5 for r in runs[baseline])  # clipping is in play
    for n, baseline in worker.BASELINE.items():
        whole = runs[baseline]
        assert [r["step"] for r in runs[n]] == [r["step"] for r in whole]
        for a, b in zip(whole, runs[n], strict=True):
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-5), (n, a, b)
            assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5, abs=1e-5), (n, a, b)
        assert weights[n].keys() == weights[baseline].keys()
        for name, value in weights[baseline].items():
            torch.testing.assert_close(weights[n][name], value, rtol=1e-5, atol=1e-5, msg=f"{n} {name}")
    # The LoRA runs trained their adapters (the merged export moved off the stored base), and only them.
    stored = load_file(model_dir / "model.safetensors")
    lora = weights["lora_tp2"]
    assert not torch.equal(
        lora["model.layers.0.self_attn.o_proj.weight"], stored["model.layers.0.self_attn.o_proj.weight"]
    )
    assert torch.equal(lora["model.layers.0.input_layernorm.weight"], stored["model.layers.0.input_layernorm.weight"])
    # Between the blocks each rank of a pair holds half the sequence (15 tokens padded to 16), or all of it when
    # asked to; the logits come out whole either way.
    for rank in range(worker.WORLD_SIZE):
        for run, norm_tokens in (
            ("tp2", 8),
            ("tp2_replicated_whole_activations", 15),
            ("tp2_checkpointing_resumed", 8),
        ):
            shapes = json.loads((tmp_path / f"residual_{run}_rank{rank}.json").read_text())
            assert shapes == {"norm_input": [1, norm_tokens, 64], "logits": [1, 15, 512]}, (run, rank, shapes)
    # With sequence parallel beside, some chunks were odd and came to the ring attention padded for the pair.
    for rank in range(worker.WORLD_SIZE):
        for run in ("tp2_sp2", "tp2_sp2_ulysses"):
            counts = json.loads((tmp_path / f"padded_chunks_{run}_rank{rank}.json").read_text())
            assert counts["calls"] > counts["padded"] > 0, (run, rank, counts)
    # A deepspeed run without AutoTP after runs with it, in the same processes, is refused by name.
    for rank in range(worker.WORLD_SIZE):
        message = (tmp_path / f"after_autotp_rank{rank}.txt").read_text()
        assert "built a DeepSpeed AutoTP engine of tensor_parallel_size 2 already" in message, (rank, message)
    # The adapters split with the layers they wrap: B by output rows beside a column-split layer, A by input
    # columns beside a row-split one.
    split = {
        "q_proj.base_layer.weight": "Shard(0)", "q_proj.base_layer.bias": "Shard(0)",
        "q_proj.lora_A.default.weight": "whole", "q_proj.lora_B.default.weight": "Shard(0)",
        "o_proj.base_layer.weight": "Shard(1)",
        "o_proj.lora_A.default.weight": "Shard(1)", "o_proj.lora_B.default.weight": "whole",
    }  # fmt: skip
    for rank in range(worker.WORLD_SIZE):
        assert json.loads((tmp_path / f"lora_blocks_rank{rank}.json").read_text()) == split, rank
    # AutoTP really split the layers: q_proj by its output rows, down_proj by its input columns.
    for rank in range(worker.WORLD_SIZE):
        shapes = json.loads((tmp_path / f"autotp_rank{rank}.json").read_text())
        assert shapes == {"q_proj": [32, 64], "down_proj": [64, 128]}, (rank, shapes)
    moved = load_file(model_dir / "model.safetensors")
    assert any(not torch.allclose(moved[k], weights["tp1"][k]) for k in moved)  # training changed the weights


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"engine": {"backend": "local", "tensor_parallel_size": 2}}, "needs engine.backend 'fsdp2' or 'deepspeed'"),
        (
            {"engine": {"backend": "deepspeed", "zero_stage": 3, "tensor_parallel_size": 2}},
            "needs engine.zero_stage 1 or 2",
        ),
        ({"engine": {"backend": "fsdp2", "tensor_parallel_size": 2, "num_processes": 3}}, "must divide"),
        (
            {
                "engine": {
                    "backend": "fsdp2",
                    "tensor_parallel_size": 2,
                    "sequence_parallel_size": 2,
                    "num_processes": 6,
                }
            },
            r"engine.tensor_parallel_size x engine.sequence_parallel_size \(2 x 2\) must divide engine.num_processes",
        ),
        (
            {
                "engine": {
                    "backend": "deepspeed",
                    "tensor_parallel_size": 2,
                    "sequence_parallel_size": 2,
                    "num_processes": 6,
                }
            },
            r"engine.tensor_parallel_size x engine.sequence_parallel_size \(2 x 2\) must divide engine.num_processes",
        ),
        (
            {
                "engine": {"backend": "deepspeed", "tensor_parallel_size": 2},
                "model": {"path": "m", "lora": {"rank": 4}},
            },
            r"\(AutoTP\) does not support model.lora",
        ),
        ({"engine": {"backend": "deepspeed", "data_parallel_shard_size": 2}}, "data_parallel_shard_size needs"),
        (
            {
                "engine": {
                    "backend": "fsdp2",
                    "num_processes": 8,
                    "tensor_parallel_size": 2,
                    "data_parallel_shard_size": 3,
                }
            },
            r"must divide the data-parallel ranks \(engine.num_processes / engine.tensor_parallel_size = 4\)",
        ),
    ],
)
def test_tensor_parallel_settings_that_cannot_work_are_refused_by_name(fields, message):
    data = {"model": {"path": "m"}, "data": {"train": ["t.jsonl"]}, **fields}
    with pytest.raises(ConfigError, match=message):
        parse_config(SFTConfig, data)


def test_a_model_whose_heads_the_ranks_cannot_split_is_refused_by_name():
    from torch.distributed.device_mesh import DeviceMesh

    from raylign.engine.fsdp2 import apply_tensor_parallel
    from tests.engine.engine_testing import tiny_model

    class ThreeRanks(DeviceMesh):  # only its size is read before the check fails
        def __init__(self):
            pass

        def size(self, mesh_dim=None):
            return 3

    model = tiny_model()
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3: .* num_attention_heads=4, num_key_value_heads=2"):
        apply_tensor_parallel(model, ThreeRanks())
