"""Atomic checkpoint protocol, pruning, RNG and client-state round trips (single process)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from raylign.config.optim import OptimConfig
from raylign.engine import create_engine
from raylign.engine.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    resume_latest,
    save_step_checkpoint,
    temp_directory,
)

from .engine_testing import local_cfg, tiny_model, token_batch

OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, weight_decay=0.1, max_grad_norm=1.0)


def make_engine(seed: int = 0):
    return create_engine(tiny_model(seed), local_cfg(), OPTIM, total_steps=10)


def train_step(engine, seed: int) -> None:
    ids = token_batch(seed)
    engine.backward(engine.module(input_ids=ids, labels=ids).loss)
    engine.step()


def weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def make_complete(folder) -> None:
    folder.mkdir(parents=True)
    (folder / "COMPLETE").write_text("ok\n")


def test_latest_checkpoint_ignores_temp_unmarked_and_foreign_folders(tmp_path):
    make_complete(tmp_path / "step_2")
    make_complete(tmp_path / "step_10")
    (tmp_path / "step_11").mkdir()  # no COMPLETE marker
    (tmp_path / ".step_12.tmp").mkdir()  # an interrupted save, never marked complete
    make_complete(tmp_path / "step_final")
    (tmp_path / "step_13").write_text("a file, not a folder")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"  # numeric, not lexical, order


def test_latest_checkpoint_of_missing_or_empty_root_is_none(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None
    assert latest_checkpoint(tmp_path) is None


def test_saved_checkpoint_is_complete_and_keep_last_prunes_older_ones(tmp_path):
    engine = make_engine()
    stale = temp_directory(tmp_path / "step_9")
    stale.mkdir(parents=True)  # left by an earlier crashed save
    for step in range(1, 5):
        train_step(engine, step)
        save_step_checkpoint(engine, tmp_path, step, {"step": step}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]
    final = tmp_path / "step_4"
    assert (final / "COMPLETE").is_file()
    files = {p.name: p.stat().st_size for p in final.iterdir() if p.name not in ("meta.json", "COMPLETE")}
    assert sorted(files) == ["client_state_rank0.pt", "engine_state.pt", "rng_rank0.pt", "scheduler.pt"]
    meta = {"backend": "local", "world_size": 1, "format_version": 1, "files": files}
    assert json.loads((final / "meta.json").read_text()) == meta


def test_saving_the_same_step_again_replaces_it(tmp_path):
    engine = make_engine()
    train_step(engine, 1)
    save_step_checkpoint(engine, tmp_path, 1, {"version": "first"})
    train_step(engine, 2)
    save_step_checkpoint(engine, tmp_path, 1, {"version": "second"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert make_engine().load_checkpoint(tmp_path / "step_1") == {"version": "second"}


def test_a_save_stopped_while_replacing_its_step_leaves_a_checkpoint_that_resume_finds(tmp_path):
    # Saving step 1 again: the new copy was marked complete, the old one moved aside to .step_1.old,
    # and the run stopped before the new one was renamed into place. The new copy is whole.
    engine = make_engine()
    train_step(engine, 1)
    save_step_checkpoint(engine, tmp_path, 1, {"version": "first"})
    train_step(engine, 2)
    save_step_checkpoint(engine, tmp_path, 1, {"version": "second"})
    (tmp_path / "step_1").rename(tmp_path / ".step_1.tmp")
    make_complete(tmp_path / ".step_1.old")
    assert latest_checkpoint(tmp_path) == tmp_path / ".step_1.tmp"
    assert make_engine().load_checkpoint(latest_checkpoint(tmp_path)) == {"version": "second"}
    # A later save keeps it among the keep_last newest; only the moved-aside copy is let go.
    train_step(engine, 3)
    save_step_checkpoint(engine, tmp_path, 2, {"version": "third"}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_1.tmp", "step_2"]


def test_resume_continues_bitwise_like_an_uninterrupted_run(tmp_path):
    uninterrupted = make_engine()
    for step in range(1, 5):
        train_step(uninterrupted, step)
        if step == 2:
            save_step_checkpoint(uninterrupted, tmp_path, step, {"step": step})
    resumed = make_engine(seed=1)  # different initial weights: everything must come from the checkpoint
    client_state = resume_latest(resumed, tmp_path)
    assert client_state == {"step": 2}
    for step in range(3, 5):
        train_step(resumed, step)
    expected = weights(uninterrupted)
    for name, tensor in weights(resumed).items():
        assert torch.equal(tensor, expected[name]), name
    assert resumed.scheduler.last_epoch == uninterrupted.scheduler.last_epoch == 4


def test_rng_states_and_client_state_round_trip(tmp_path):
    engine = make_engine()
    client_state = {"step": 3, "loader": {"epoch": 1, "index": 17, "order": [4, 2, 9]}}
    save_step_checkpoint(engine, tmp_path, 3, client_state)
    draws_after_save = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    assert make_engine().load_checkpoint(tmp_path / "step_3") == client_state
    draws_after_load = (random.random(), float(np.random.rand()), torch.rand(3))
    assert draws_after_load[:2] == draws_after_save[:2]
    assert torch.equal(draws_after_load[2], draws_after_save[2])


def test_loading_an_incomplete_checkpoint_names_it(tmp_path):
    engine = make_engine()
    save_step_checkpoint(engine, tmp_path, 1, {})
    (tmp_path / "step_1" / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match=r"step_1 is incomplete or missing \(no COMPLETE marker\)"):
        engine.load_checkpoint(tmp_path / "step_1")


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("delete meta.json", "meta.json: no such file"),
        ("truncate meta.json", "meta.json: not valid JSON"),
        ("delete scheduler.pt", "scheduler.pt is missing"),
        ("truncate scheduler.pt", "scheduler.pt is {half} bytes, {size} when written"),
        ("delete engine_state.pt", "engine_state.pt is missing"),
        ("truncate engine_state.pt", "engine_state.pt is {half} bytes, {size} when written"),
        ("delete client_state_rank0.pt", "client_state_rank0.pt is missing"),
        ("truncate rng_rank0.pt", "rng_rank0.pt is {half} bytes, {size} when written"),
        # Written before meta.json listed the files: each is checked as it is read.
        ("truncate-unlisted scheduler.pt", "scheduler.pt cannot be read (PytorchStreamReader failed"),
        ("truncate-unlisted client_state_rank0.pt", "client_state_rank0.pt cannot be read ("),
    ],
)
def test_loading_a_marked_checkpoint_with_a_missing_or_damaged_file_names_the_folder_and_the_file(
    tmp_path, damage, problem
):
    # A copy cut short (cp -r, rsync) can hold the COMPLETE marker, which sorts first, without the rest.
    engine = make_engine()
    save_step_checkpoint(engine, tmp_path, 1, {"step": 1})
    action, name = damage.split()
    path = tmp_path / "step_1" / name
    size = path.stat().st_size
    meta_file = tmp_path / "step_1" / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert name == "meta.json" or meta["files"][name] == size
    if action == "truncate-unlisted":
        del meta["files"]
        meta_file.write_text(json.dumps(meta))
    if action == "delete":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[: size // 2])
    problem = problem.format(half=size // 2, size=size)
    with pytest.raises(CheckpointError) as err:
        engine.load_checkpoint(tmp_path / "step_1")
    message = str(err.value)
    assert message.startswith(f"checkpoint {tmp_path / 'step_1'} is damaged: ")
    assert problem in message
    assert message.endswith("Delete this folder to resume from the checkpoint before it")


def test_loading_a_checkpoint_of_another_world_size_is_refused(tmp_path):
    engine = make_engine()
    save_step_checkpoint(engine, tmp_path, 1, {})
    meta_file = tmp_path / "step_1" / "meta.json"
    meta_file.write_text(json.dumps({"backend": "local", "world_size": 2, "format_version": 1}))
    with pytest.raises(CheckpointError, match="written by 2 ranks; this run has 1"):
        engine.load_checkpoint(tmp_path / "step_1")


def test_a_run_started_over_in_the_same_folder_keeps_its_checkpoint_and_drops_the_later_ones_it_replaces(tmp_path):
    replaced = make_engine()
    for step in (4, 5):  # a run that got further, then started over with train.resume false
        save_step_checkpoint(replaced, tmp_path, step, {"run": "replaced"}, keep_last=2)
    again = make_engine(seed=1)
    train_step(again, 1)
    save_step_checkpoint(again, tmp_path, 1, {"run": "again"}, keep_last=2)
    # Kept among the two newest, step_4 and step_5 would push out the checkpoint just written, and a
    # resume would continue the replaced run's weights.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert make_engine().load_checkpoint(latest_checkpoint(tmp_path)) == {"run": "again"}
