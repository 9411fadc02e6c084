"""rm, prm, dpo, kto and kd with tensor parallelism: every attention and MLP matrix split over 2 gloo
ranks trains like one process holding whole layers.

Each command's shipped tiny example runs 3 steps on a model with 4 key/value heads, split over 2
ranks (``offline_tensor_parallel_worker``; dpo also with DeepSpeed AutoTP), and on one process with
the local engine. The loss and gradient norm (clipped at 0.5) of every step and the exported weights
agree; each rank held half of ``q_proj``'s rows. The frozen models (the DPO and KTO references, the
KD teacher, another random model) are sharded over both ranks by fsdp2, whole layers gathered in
turn. The process reward model grows its embedding by one token (its step separator) to a row count
both ranks split evenly. DPO and RM also train a LoRA policy this way, its adapters split with their
matrices (DPO's reference: the policy with its adapters off; RM's score head trained whole beside them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raylign.models.tiny import build_tiny_model
from raylign.trainers.metrics import read_metrics
from tests.spawned_ranks import import_worker, spawn_and_join

worker = import_worker(__file__, "offline_tensor_parallel_worker")


def steps(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if "train/loss" in r]


@pytest.mark.slow
@pytest.mark.distributed
def test_each_offline_command_trains_with_matrices_split_over_ranks_as_with_whole_layers(tmp_path, monkeypatch):
    model_dir = build_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4)
    build_tiny_model(tmp_path / "model-teacher", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, seed=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        spawn_and_join(worker.run_rank, (str(model_dir), str(tmp_path / "tp2")), 2, 900, "TP ranks")
    monkeypatch.chdir(worker.REPO)
    runs = [(c, c, 0) for c in worker.COMMANDS] + [("dpo", "dpo_deepspeed", 0)]
    runs += [(c, f"{c}_lora", 4) for c in worker.LORA_COMMANDS]
    for command, run, lora_rank in runs:
        whole_run = f"{command}_lora" if lora_rank else command
        if not (tmp_path / "whole" / whole_run).exists():
            out = tmp_path / "whole" / whole_run
            whole = worker.command_config(command, str(model_dir), out, {"backend": "local"}, lora_rank)
            worker.trainer_class(command)(whole).run()

        split, reference = steps(tmp_path / "tp2" / run), steps(tmp_path / "whole" / whole_run)
        assert [r["step"] for r in reference] == list(range(1, worker.STEPS + 1)), command
        assert [r["step"] for r in split] == [r["step"] for r in reference], command
        for a, b in zip(reference, split, strict=True):
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-5), (run, a, b)
            assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5, abs=1e-5), (run, a, b)
        expected = load_file(tmp_path / "whole" / whole_run / "final" / "model.safetensors")
        exported = load_file(tmp_path / "tp2" / run / "final" / "model.safetensors")
        assert exported.keys() == expected.keys(), command
        for name, value in expected.items():
            mine = exported[name]
            if command == "prm" and name.endswith("embed_tokens.weight"):  # the padding row is never read
                assert (mine.shape[0], value.shape[0]) == (514, 513)
                mine = mine[:513]
            torch.testing.assert_close(mine, value, rtol=1e-5, atol=1e-5, msg=f"{run} {name}")
    assert any(r["train/grad_norm"] > 0.5 for c in worker.COMMANDS for r in steps(tmp_path / "whole" / c))
    # The adapters trained: the merged export of each LoRA run moved from the initial weights.
    initial = load_file(model_dir / "model.safetensors")
    for command in worker.LORA_COMMANDS:
        merged = load_file(tmp_path / "whole" / f"{command}_lora" / "final" / "model.safetensors")
        moved = [name for name, value in initial.items() if name.endswith("q_proj.weight")]
        assert moved and all(not torch.equal(merged[name], initial[name]) for name in moved), command
    for rank in range(2):
        shapes = json.loads((tmp_path / "tp2" / f"shapes_rank{rank}.json").read_text())
        assert shapes == {command: [32, 64] for command in worker.COMMANDS}, (rank, shapes)
    # prm: 512 tokens + its step separator, padded to an even 514 rows for the split
    assert json.loads((tmp_path / "tp2" / "prm" / "final" / "config.json").read_text())["vocab_size"] == 514


@pytest.mark.parametrize("command", worker.COMMANDS)
def test_lora_under_autotp_is_refused_by_name_before_anything_starts(command, tmp_path):
    from raylign.config.base import ConfigError

    engine = {"backend": "deepspeed", "num_processes": 2, "tensor_parallel_size": 2}
    with pytest.raises(ConfigError, match=r"\(AutoTP\) does not support model.lora"):
        worker.command_config(command, str(tmp_path), tmp_path / "out", {**engine}, lora_rank=4)
