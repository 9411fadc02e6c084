"""Asynchronous rollout (``rollout.max_staleness: 1``): the next step's samples are generated while
the current step trains, so they come from weights one update old, and a run killed mid-step
picks up the prompts that were in flight at its last checkpoint."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import TIMING_PARTS, resolve, rl_config_data

pytestmark = pytest.mark.slow


def _async_run_config(model_dir, prompt_file, out):
    data = rl_config_data(model_dir, prompt_file, out, "grpo")
    data["train"].update(max_steps=3, log_samples=16)
    # Reproducible: groups enter steps in start order, so a resumed run's steps hold the same prompts.
    data["rollout"].update(max_staleness=1, reproducible=True)
    data["optim"]["scheduler"] = "constant"
    return data


def test_async_samples_are_one_update_old(ray_session, rl_model_dir, prompt_file, tmp_path):
    straight = _async_run_config(rl_model_dir, prompt_file, tmp_path / "straight")
    straight["data"]["eval"] = [{"path": str(prompt_file)}]
    straight["train"]["eval_every"] = 1  # evaluations share the engines with the training stream
    # No KL term: its reference pass would start a reference actor beside the stream (train.early_reference),
    # whose log-probs tests/rl/test_rl_early_reference.py checks; the killed-run test below keeps one.
    straight["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0}
    trainer = RLTrainer(resolve(tmp_path, straight))
    trainer.run()
    rows = read_metrics(tmp_path / "straight")
    # One evaluation per weight version, each logged under the step whose weights generated it.
    assert sorted(r["step"] for r in rows if "eval/all/reward_mean" in r) == [0, 1, 2, 3]
    records = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    # The stream: when step 2 began training, the groups of step 3 were still generating (they
    # started after step 1's weight sync, and the engine finished them after step 2's training began).
    assert records[1]["rollout/groups_in_flight"] > 0
    train_began = {step: t for what, step, t in trainer.events if what == "train"}
    finished = [t for step, _, t in trainer.group_log if step == 3]
    assert max(finished) > train_began[2]
    # Step 1 is generated before any update; steps 2 and 3 were generated during the step before,
    # by the engines one weight sync behind the policy that trains on them.
    assert [r["rollout/weight_lag"] for r in records] == [0, 1, 1]
    for record in records:
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float))
        assert record["policy/grad_norm"] > 0
        # Reproducible: the groups in flight are scored while the sync phase waits for them; that time is
        # time/reward_s's alone, so the parts stay disjoint intervals inside the step.
        assert sum(record[k] for k in TIMING_PARTS) <= record["time/step_s"] + 1e-6
    # The ratio runs against the engine's log-probs of weights one update old: no longer 1 (KL > 0).
    assert records[2]["policy/approx_kl"] > 0
    # The engine generates beside training and keeps its one reserved core (rollout.num_cpus_per_engine):
    # the policy trains on the others, at least one.
    assert {r["threads/train"] for r in records} == {max(1, len(os.sched_getaffinity(0)) - 1)}
    # Started again once finished: nothing to train, the last step evaluated again and logged once.
    RLTrainer(resolve(tmp_path, straight)).run()
    rows = read_metrics(tmp_path / "straight")
    assert sorted(r["step"] for r in rows if "eval/all/reward_mean" in r) == [0, 1, 2, 3]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]


def test_a_reproducible_stream_killed_mid_step_resumes_to_the_same_weights(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    """``rollout.reproducible`` with seeded sampling, two updates of staleness, decoupled PPO: a run
    killed with SIGKILL while step 3 trains and step 4's groups are generating, then started again,
    trains on the prompts that were in flight at its last checkpoint and ends with the same weights
    as a run that was never stopped. The killed run is a separate
    ``raylign rl`` process joined to this session's Ray (its actors die with it)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from .rl_helpers import state_dict_of, write_yaml

    def config(out):
        data = _async_run_config(rl_model_dir, prompt_file, out)
        data["rollout"]["max_staleness"] = 2
        data["algorithm"] = {"off_policy": "truncated_is"}
        data["train"].update(max_steps=4, save_every=1)
        return data

    RLTrainer(resolve(tmp_path, config(tmp_path / "straight"))).run()

    killed = tmp_path / "killed"
    joined = config(killed)
    joined.setdefault("placement", {})["ray_address"] = ray_session.get_runtime_context().gcs_address
    spec = write_yaml(tmp_path / "killed.yaml", joined)
    proc = subprocess.Popen(
        [sys.executable, "-m", "raylign.cli.main", "rl", "--config", str(spec)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 600
        while not (killed / "checkpoints" / "step_2").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint of step 2 within 600 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, mid-step 3
        proc.wait(timeout=60)
    assert not (killed / "final").exists()
    RLTrainer(resolve(tmp_path, config(killed))).run()

    steps = {name: [r for r in read_metrics(tmp_path / name) if "reward/mean" in r] for name in ("straight", "killed")}
    assert [r["step"] for r in steps["killed"]] == [1, 2, 3, 4]  # once each, however far step 3 had got
    resumed = {r["step"]: r for r in steps["killed"]}
    for row in steps["straight"]:
        assert resumed[row["step"]]["reward/mean"] == pytest.approx(row["reward/mean"], abs=1e-6)
        assert resumed[row["step"]]["policy/policy_loss"] == pytest.approx(row["policy/policy_loss"], abs=1e-6)
    straight, again = state_dict_of(tmp_path / "straight" / "final"), state_dict_of(killed / "final")
    for name, tensor in straight.items():
        assert torch.allclose(tensor, again[name], atol=1e-6), name


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_with_long_tailed_lengths_training_begins_before_the_longest_sequence_ends(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    """Long-tailed lengths on vLLM's streaming engine: the tiny model's samples mostly hit a stop
    string within a few tokens, a few run to ``max_new_tokens``. With ``max_staleness: 1`` two steps'
    groups are in flight and a step takes the first ones to finish, so it trains while a group started
    before some of its own groups is still generating (from the event timestamps), and that group
    enters a later step."""
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run", "grpo")
    data["train"].update(max_steps=3, save_every=0)
    data["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0}  # no reference actor: the stream is what is tested
    # On the random tiny model, stopping at "q" or "7" gives a median of about 18 of 64 tokens, with
    # about one sample in seven running to the limit.
    data["sampling"].update(max_new_tokens=64, stop=["q", "7"])
    data["rollout"] = {
        "engine": "vllm",
        "dtype": "float32",
        "kv_cache_memory_bytes": 32 << 20,
        "max_model_len": 256,
        "sync_timeout_s": 60,
        "max_staleness": 1,
    }
    trainer = RLTrainer(resolve(tmp_path, data))
    trainer.run()
    records = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert max(r["response_length/max"] for r in records) == 64
    assert sum(r["response_length/mean"] for r in records) / len(records) < 40  # most stop well before
    train_began = {step: t for what, step, t in trainer.events if what == "train"}
    newest_seq = {step: max(seq for s, seq, _ in trainer.group_log if s == step) for step in train_began}
    overtaken = [
        (step, seq)
        for step in train_began
        for later, seq, finished in trainer.group_log
        if later > step and seq < newest_seq[step] and finished > train_began[step]
    ]
    assert overtaken, trainer.group_log
