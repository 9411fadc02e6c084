"""SFT with sequence parallelism: a packed row split over 2 gloo ranks trains exactly like whole rows.

Two runs of the same data and seed on 2 ranks: ``engine.sequence_parallel_size`` 1 (each rank
holds whole rows of half the batch) and 2 (both ranks share every row, one half each, with ring
attention between them). The loss and gradient norm of every step and the final weights agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raylign.config.base import ConfigError, parse_config
from raylign.config.commands import SFTConfig
from raylign.config.rm import RMConfig
from raylign.tasks.strings import make_string_rows
from raylign.trainers.metrics import read_metrics
from tests.spawned_ranks import free_port, import_worker, spawn_and_join

from .test_sft import write_jsonl

worker = import_worker(__file__, "sft_sequence_parallel_worker")


@pytest.mark.slow
@pytest.mark.distributed
def test_sft_with_rows_split_over_two_ranks_trains_like_whole_rows(tmp_path, tiny_model_dir):
    train_file = write_jsonl(tmp_path / "train.jsonl", make_string_rows("reverse", 16, seed=0))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        args = (free_port(), str(tiny_model_dir), str(train_file), str(tmp_path))
        spawn_and_join(worker.run_rank, args, worker.WORLD_SIZE, 600, "SFT ranks")
    whole, split = ([r for r in read_metrics(tmp_path / f"sp{n}") if "train/loss" in r] for n in (1, 2))
    assert [r["step"] for r in whole] == [r["step"] for r in split] == list(range(1, worker.STEPS + 1))
    for a, b in zip(whole, split, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5, abs=1e-5), (a, b)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5, abs=1e-5), (a, b)
    weights_whole = load_file(tmp_path / "sp1" / "final" / "model.safetensors")
    weights_split = load_file(tmp_path / "sp2" / "final" / "model.safetensors")
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
        ({"backend": "deepspeed", "sequence_parallel_size": 2}, "engine.sequence_parallel_size 2 needs engine.backend"),
        ({"sequence_parallel_size": 2, "num_processes": 3}, "must divide engine.num_processes"),
        ({"sequence_parallel_size": 2, "packing": False}, "data.packing must be true"),
        (
            {"sequence_parallel_size": 2, "gradient_checkpointing": True},
            "does not support model.gradient_checkpointing",
        ),
    ],
)
def test_sequence_parallel_sft_configs_that_cannot_run_are_refused(engine, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(SFTConfig, _sft(**engine))


def test_commands_without_sequence_parallelism_refuse_it():
    config = {
        "model": {"path": "m"},
        "data": {"train": ["t.jsonl"]},
        "engine": {"backend": "fsdp2", "sequence_parallel_size": 2},
    }
    with pytest.raises(ConfigError, match="engine.sequence_parallel_size: rm does not support"):
        parse_config(RMConfig, config)
