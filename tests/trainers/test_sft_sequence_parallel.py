"""SFT (full, LoRA, with gradient checkpointing, under DeepSpeed ZeRO-3, with Ulysses attention) and KD with
sequence parallelism: a packed row split over 2 gloo ranks trains exactly like whole rows.

Two runs of the same data and seed on 2 ranks: ``engine.sequence_parallel_size`` 1 (each rank
holds whole rows of half the batch) and 2 (both ranks share every row, one half each, with ring
attention between them). The loss and gradient norm of every step and the final weights (for LoRA,
the merged export) agree, also when the split run recomputes its layers in backward (gradient
checkpointing: the recomputed ring attention must reach the other rank's half again); for
KD (forward KL plus half the NLL, the teacher split like the student) so do the divergence and NLL.
"""

from __future__ import annotations

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

worker = import_worker(__file__, "sft_sequence_parallel_worker")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> Path:
    tmp = tmp_path_factory.mktemp("sft_sp")
    train_file = write_jsonl(tmp / "train.jsonl", make_string_rows("reverse", 16, seed=0))
    student = build_tiny_model(tmp / "student", hidden_size=32, num_layers=1, seed=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        args = (str(tiny_model_dir), str(student), str(train_file), str(tmp))
        spawn_and_join(worker.run_rank, args, worker.WORLD_SIZE, 600, "SFT and KD ranks")
    return tmp


# The run with whole rows (on 2 data-parallel ranks, fsdp2) and the run with rows split over both ranks.
COMPARED = {
    "sft": ("sp1", "sp2"),
    "lora": ("lora_sp1", "lora_sp2"),
    "checkpointed": ("sp1", "checkpointed_sp2"),  # recomputed in backward, against whole rows that are not
    "zero3": ("sp1", "zero3_sp2"),  # DeepSpeed ZeRO-3 splitting rows, against fsdp2 holding whole ones
    "ulysses": ("sp1", "ulysses_sp2"),  # all-to-all attention in place of the ring
    "kd": ("kd_sp1", "kd_sp2"),
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "command, metrics",
    [(command, ["loss"]) for command in ("sft", "lora", "checkpointed", "zero3", "ulysses")]
    + [("kd", ["loss", "divergence", "nll"])],
)
def test_rows_split_over_two_ranks_train_like_whole_rows(runs, command, metrics, tiny_model_dir):
    whole_run, split_run = COMPARED[command]
    whole = [r for r in read_metrics(runs / whole_run) if "train/loss" in r]
    split = [r for r in read_metrics(runs / split_run) if "train/loss" in r]
    assert [r["step"] for r in whole] == [r["step"] for r in split] == list(range(1, worker.STEPS + 1))
    for a, b in zip(whole, split, strict=True):
        for key in [f"train/{name}" for name in metrics] + ["train/grad_norm"]:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (a["step"], key, a[key], b[key])
    weights_whole = load_file(runs / whole_run / "final" / "model.safetensors")
    weights_split = load_file(runs / split_run / "final" / "model.safetensors")
    for name, value in weights_whole.items():
        torch.testing.assert_close(weights_split[name], value, rtol=1e-5, atol=1e-5, msg=name)


def _sft(**engine) -> dict:
    return {
        "model": {"path": "m", "gradient_checkpointing": engine.pop("gradient_checkpointing", False)},
        "data": {"train": ["t.jsonl"], "packing": engine.pop("packing", True)},
        "engine": {"backend": "fsdp2", **engine},
    }


@pytest.mark.parametrize(
    "engine, message",
    [
        ({"backend": "local", "sequence_parallel_size": 2}, "engine.sequence_parallel_size 2 needs engine.backend"),
        ({"sequence_parallel_size": 2, "num_processes": 3}, "must divide engine.num_processes"),
        ({"sequence_parallel_size": 2, "packing": False}, "data.packing must be true"),
    ],
)
def test_sequence_parallel_sft_configs_that_cannot_run_are_refused(engine, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(SFTConfig, _sft(**engine))


def test_a_command_whose_rows_are_not_split_refuses_sequence_parallelism():
    from raylign.config.engine import EngineConfig, refuse_unsupported_layouts
    from raylign.config.model import ModelConfig

    engine = EngineConfig(backend="fsdp2", sequence_parallel_size=2)
    with pytest.raises(ValueError, match="engine.sequence_parallel_size: grpo-offline does not support"):
        refuse_unsupported_layouts(engine, ModelConfig(path="m"), "grpo-offline")
