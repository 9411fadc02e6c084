"""Faults during an offline run: an output folder that cannot be written, a kill between two files
of a checkpoint, a disk that fills up during a save, a DPO driver killed with SIGKILL between two
checkpoints, one rank of a two-rank run killed. Each run either stops at once with an error that
names the folder or the rank, or resumes to the weights of a run that was never interrupted."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from raylign.engine.checkpoint import CheckpointError
from raylign.tasks.strings import make_string_rows
from raylign.trainers.dpo import DPOTrainer
from raylign.trainers.metrics import read_metrics
from raylign.trainers.sft import SFTTrainer

from .test_dpo import all_a_pairs, dpo_config
from .test_sft import sft_config, write_jsonl


def _assert_same_final_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=0, msg=name)


@pytest.fixture
def train_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", make_string_rows("reverse", 96, seed=0))


@pytest.fixture
def straight(tmp_path, tiny_model_dir, train_file):
    """An uninterrupted run of 6 steps with checkpoints at 3 and 6: the reference."""
    out = tmp_path / "straight"
    SFTTrainer(sft_config(tiny_model_dir, train_file, out, max_steps=6, save_every=3, keep_last=1)).run()
    return out


def test_an_output_folder_that_cannot_be_written_stops_the_run_before_it_trains(tmp_path, tiny_model_dir, train_file):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")

    class NeverBuilds(SFTTrainer):
        def build_model(self):
            raise AssertionError("the model was built before the output folder was checked")

    with pytest.raises(CheckpointError, match=rf"train.output_dir {blocker}/run cannot be written \(Not a directory\)"):
        NeverBuilds(sft_config(tiny_model_dir, train_file, blocker / "run", max_steps=2)).run()


KILL_MID_SAVE = textwrap.dedent("""
    import os, sys, torch, yaml
    from raylign.config.base import parse_config
    from raylign.config.commands import SFTConfig
    from raylign.trainers.sft import SFTTrainer

    save = torch.save

    def dies_between_two_files(obj, f, *args, **kwargs):
        # the engine state of step N is written; the process dies before the scheduler's file
        if str(f).endswith("scheduler.pt") and f".step_{sys.argv[2]}.tmp" in str(f):
            os._exit(17)
        return save(obj, f, *args, **kwargs)

    torch.save = dies_between_two_files
    SFTTrainer(parse_config(SFTConfig, yaml.safe_load(open(sys.argv[1])))).run()
""")


@pytest.mark.slow
def test_a_kill_between_two_files_of_a_checkpoint_resumes_from_the_one_before(
    tmp_path, tiny_model_dir, train_file, straight
):
    cfg = sft_config(tiny_model_dir, train_file, tmp_path / "killed", max_steps=6, save_every=3, keep_last=1)
    (tmp_path / "killed.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    (tmp_path / "dies.py").write_text(KILL_MID_SAVE)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "dies.py"), str(tmp_path / "killed.yaml"), "6"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 17, proc.stderr[-2000:]
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert (checkpoints / ".step_6.tmp" / "engine_state.pt").exists()  # half a checkpoint was left
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == ["step_3"]

    SFTTrainer(cfg).run()  # resumes from step 3, not from the half-written step 6
    assert not (checkpoints / ".step_6.tmp").exists()
    _assert_same_final_weights(straight, tmp_path / "killed")


def _mount_tmpfs(folder: Path, size_bytes: int) -> None:
    folder.mkdir(parents=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", f"raylign-{uuid.uuid4().hex[:8]}", str(folder)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode:
        pytest.skip(f"a small filesystem to fill is a tmpfs mount, which this machine refuses: {proc.stderr.strip()}")


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_stops_the_run_and_loses_nothing(
    tmp_path, tiny_model_dir, train_file, straight
):
    """The output folder is a filesystem with room for one checkpoint and a half: the checkpoint of
    step 3 fits, the one of step 6 (written beside it before step 3's is pruned) does not."""
    one_checkpoint = _size(straight / "checkpoints" / "step_6")
    logs = _size(straight) - _size(straight / "checkpoints") - _size(straight / "final")  # config, metrics, events
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, int(1.5 * one_checkpoint) + logs + 2**16)
    try:
        cfg = sft_config(tiny_model_dir, train_file, disk / "run", max_steps=6, save_every=3, keep_last=1)
        with pytest.raises(CheckpointError) as err:
            SFTTrainer(cfg).run()
        message = str(err.value)
        assert message.startswith(f"checkpoint step_6 could not be written in {disk / 'run' / 'checkpoints'}")
        assert ": the filesystem is full (0.0 MiB free);" in message
        checkpoints = disk / "run" / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step_3"]  # the partial folder is gone
        moved = tmp_path / "moved"
        shutil.copytree(disk / "run", moved)  # the user makes room: here, a bigger disk
    finally:  # lazily: a file still open there must not leave the mount behind
        subprocess.run(["umount", "--lazy", str(disk)], capture_output=True, timeout=30)
    SFTTrainer(sft_config(tiny_model_dir, train_file, moved, max_steps=6, save_every=3, keep_last=1)).run()
    _assert_same_final_weights(straight, moved)


SIGKILL_AFTER_LOGGING = textwrap.dedent("""
    import os, signal, sys, yaml
    from raylign.config.base import parse_config
    from raylign.config.dpo import DPOConfig
    from raylign.trainers.dpo import DPOTrainer

    class KilledAfterLogging(DPOTrainer):
        # logs step N, then the driver gets SIGKILL: no cleanup, no checkpoint of step N, no export

        def setup(self):
            super().setup()
            log = self.metrics.log

            def log_then_die(metrics, step):
                log(metrics, step)
                if step == int(sys.argv[2]):
                    os.kill(os.getpid(), signal.SIGKILL)

            self.metrics.log = log_then_die

    KilledAfterLogging(parse_config(DPOConfig, yaml.safe_load(open(sys.argv[1])))).run()
""")


def test_a_dpo_driver_killed_after_a_checkpoint_resumes_to_identical_weights(tmp_path, tiny_model_dir):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", all_a_pairs(32, seed=0))
    straight = tmp_path / "straight"
    DPOTrainer(dpo_config(tiny_model_dir, pairs, straight, max_steps=4, save_every=2)).run()

    cfg = dpo_config(tiny_model_dir, pairs, tmp_path / "killed", max_steps=4, save_every=2)
    (tmp_path / "killed.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    (tmp_path / "dies.py").write_text(SIGKILL_AFTER_LOGGING)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "dies.py"), str(tmp_path / "killed.yaml"), "3"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    killed = tmp_path / "killed"
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step_2"]
    assert not (killed / "final").exists()
    assert [r["step"] for r in read_metrics(killed) if "train/loss" in r] == [1, 2, 3]

    DPOTrainer(cfg).run()  # resumes from step 2; the step 3 logged before the kill is superseded
    assert [r["step"] for r in read_metrics(killed)] == [0, 1, 2, 3, 4]  # the data record, then each step once
    superseded = (killed / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded] == [3]
    _assert_same_final_weights(straight, killed)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_one_rank_of_two_killed_ends_the_run_at_once_naming_it(tmp_path, tiny_model_dir, train_file):
    """``raylign sft`` with two ranks (torchrun): rank 1 killed with SIGKILL once step 1 is logged
    ends the whole command within seconds, non-zero, with the rank and the signal named."""
    import psutil

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "raylign.cli.main",
        "sft",
        "--model.path",
        str(tiny_model_dir),
        "--model.dtype",
        "float32",
        "--data.train",
        str(train_file),
        "--data.format",
        "chat",
        "--data.max_length",
        "64",
        "--train.output_dir",
        str(out),
        "--train.max_steps",
        "1000",
        "--train.global_batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
        "--train.logging.progress_bar",
        "false",
        "--engine.backend",
        "fsdp2",
        "--engine.num_processes",
        "2",
    ]
    process = subprocess.Popen(
        cmd,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not any(r.get("step", 0) >= 1 for r in _records(out / "metrics.jsonl")):
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "step 1 was not logged within 240 s"
            time.sleep(0.1)
        rank_1 = [
            p
            for p in psutil.Process(process.pid).children(recursive=True)
            if p.environ().get("RANK") == "1" and "raylign.cli.main" in " ".join(p.cmdline())
        ]
        assert len(rank_1) == 1, rank_1
        killed_at = time.monotonic()
        rank_1[0].send_signal(signal.SIGKILL)
        code = process.wait(timeout=120)
        stopped_s = time.monotonic() - killed_at
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    output = process.stdout.read().decode()
    assert code != 0
    assert stopped_s < 60, f"the run took {stopped_s:.0f} s to end after the kill"
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", output) and "SIGKILL" in output, output[-3000:]
    print(f"one rank of two killed: the command ended {stopped_s:.1f} s later with exit code {code}")


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    except FileNotFoundError:
        return []
