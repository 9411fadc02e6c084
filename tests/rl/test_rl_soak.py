"""A soak run (opt-in: ``pytest -m soak``): a few hundred GRPO steps with checkpoints every few
steps, the driver and engine actors killed with SIGKILL on a seeded schedule, ending with the
same weights as a run that was never interrupted.

``RAYLIGN_SOAK_STEPS`` and ``RAYLIGN_SOAK_SEED`` change its length and its schedule."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import resolve, rl_config_data, state_dict_of, write_yaml

pytestmark = pytest.mark.soak

STEPS = int(os.environ.get("RAYLIGN_SOAK_STEPS", "200"))
SEED = int(os.environ.get("RAYLIGN_SOAK_SEED", "0"))


def _config(model_dir, prompt_file, out):
    data = rl_config_data(model_dir, prompt_file, out)
    data["train"].update(max_steps=STEPS, save_every=5, keep_last=2, log_samples=0, export=True)
    # Synchronous: a group an engine loses is generated again by the weights it was started under.
    # (Asynchronous runs regenerate groups lost while the policy trains with the newer weights:
    # within the staleness bound, but not a repeat of the seeded run.)
    data["rollout"].update(num_engines=2, max_engine_restarts=1000)
    data["optim"]["scheduler"] = "constant"
    return data


def _last_step(out) -> int:
    try:
        return max((r["step"] for r in read_metrics(out) if "reward/mean" in r), default=0)
    except FileNotFoundError:
        return 0


def _engine_pids() -> list[int]:
    """The processes of the engine actors alive in this session's Ray (the killed run joined it)."""
    import ray

    return sorted(
        info["Pid"]
        for info in ray._private.state.actors().values()
        if info["ActorClassName"] == "HFEngine" and info["State"] == "ALIVE"
    )


def test_a_run_killed_again_and_again_ends_with_the_weights_of_an_uninterrupted_one(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    started = time.monotonic()
    RLTrainer(resolve(tmp_path, _config(rl_model_dir, prompt_file, tmp_path / "straight"))).run()
    straight_s = time.monotonic() - started

    out = tmp_path / "killed"
    data = _config(rl_model_dir, prompt_file, out)
    data.setdefault("placement", {})["ray_address"] = ray_session.get_runtime_context().gcs_address
    spec = write_yaml(tmp_path / "killed.yaml", data)
    rng = random.Random(SEED)
    kills = {"driver": 0, "engine": 0}
    deadline = time.monotonic() + 20 * straight_s + 600
    while not (out / "final").exists():
        proc = subprocess.Popen(
            [sys.executable, "-m", "raylign.cli.main", "rl", "--config", str(spec)],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            while proc.poll() is None:
                # The next kill: some steps past where this run started, the driver or one engine.
                target = min(STEPS, _last_step(out) + rng.randint(3, 25))
                kind = rng.choice(["driver", "engine", "engine"])
                while proc.poll() is None and _last_step(out) < target:
                    assert time.monotonic() < deadline, f"the soak run did not finish; kills so far {kills}"
                    time.sleep(0.2)
                if proc.poll() is not None or target == STEPS:
                    break
                if kind == "driver":
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    os.kill(rng.choice(_engine_pids()), signal.SIGKILL)
                kills[kind] += 1
                print(f"killed the {kind} after step {_last_step(out)}", flush=True)
            proc.wait(timeout=max(60.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
        if proc.returncode not in (0, -signal.SIGKILL):
            pytest.fail(f"the run failed (exit {proc.returncode}): {proc.stderr.read().decode()[-3000:]}")

    rows = [r for r in read_metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once
    expected, got = state_dict_of(tmp_path / "straight" / "final"), state_dict_of(out / "final")
    for name, tensor in expected.items():
        assert torch.allclose(tensor, got[name], atol=1e-6), name
    killed_s = time.monotonic() - started - straight_s
    print(
        f"soak: {STEPS} steps, {kills['driver']} driver kills and {kills['engine']} engine kills survived, "
        f"same final weights; uninterrupted run {straight_s:.0f} s, killed run {killed_s:.0f} s"
    )
