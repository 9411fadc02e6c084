"""Resuming an agent RL run: the episodes in flight at the checkpoint it resumes from are started
again, counted, and the run ends as one that was never stopped.

A checkpoint does not wait for the prompt groups in flight; it records them (start order and
prompt position), and the resumed run starts them again first under the same start order, so
seeded sampling draws the same tokens (:class:`raylign.rl.stream.RolloutFeed`).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from raylign.config.rollout import SamplingConfig
from raylign.data.errors import RowRef
from raylign.engine.checkpoint import latest_checkpoint
from raylign.rl.prompts import Prompt
from raylign.rl.stream import RolloutFeed
from raylign.rl.trainer import RLTrainer
from raylign.rollout.pool import FinishedGroup
from raylign.trainers.metrics import read_metrics

from .rl_helpers import make_sample, resolve, rl_config_data, state_dict_of, write_yaml

PER_STEP, N, STEPS = 2, 2, 3

# Two policy turns; each turn's reward depends on the tokens sampled (their sum's parity), so a
# resumed run that sampled other tokens than an uninterrupted one has other rewards.
ENV_FILE = """
class ParityEnv:
    def __init__(self):
        self.turn = 0

    def reset(self, prompt, label, metadata):
        return [{"role": "user", "content": prompt}]

    def step(self, action_text, action_token_ids):
        self.turn += 1
        done = self.turn >= 2
        return None if done else "again", float(sum(action_token_ids) % 2), done, {}
"""


def _config(model_dir, prompt_file, env_file, out) -> dict[str, Any]:
    data = rl_config_data(model_dir, prompt_file, out, "grpo")
    del data["reward"]  # the environment gives the rewards
    data["algorithm"] = {"advantage": "reinforce", "kl_mode": "none", "kl_coef": 0.0}
    data["sampling"] = {"n": N, "max_new_tokens": 4, "temperature": 1.0, "seed": 5}
    data["agent"] = {"env": f"{env_file}:ParityEnv", "max_turns": 2, "max_total_tokens": 160, "log_trajectories": 1}
    data["train"].update(prompts_per_step=PER_STEP, max_steps=STEPS, save_every=1, micro_batch_tokens=256)
    # One update of staleness, reproducible: at a checkpoint the next step's groups have come back
    # and the groups of the step after it are in flight.
    data["rollout"].update(max_staleness=1, reproducible=True)
    data["optim"]["scheduler"] = "constant"
    return data


@pytest.mark.slow
def test_an_agent_run_killed_after_a_checkpoint_restarts_its_episodes_in_flight_and_ends_as_an_uninterrupted_one(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    """The driver of an agent run (a separate ``raylign rl`` process joined to this session's Ray) is
    killed with SIGKILL once its checkpoint of step 1 exists, then started again. Expected, by the
    schedule: with ``max_staleness: 1`` in reproducible mode, after step s's weight sync the groups of
    step s+1 are back (drained before the sync) and the ``PER_STEP`` groups of step s+2 have just
    started, so the checkpoint of step s has ``PER_STEP * N`` episodes in flight; the first step after
    the resume counts exactly those as restarted, every other step (and every step of a run never
    stopped) 0. Seeded fp32 sampling on the hf engine, one prompt at a time: the restarted episodes
    draw the same tokens, so each step's rewards and loss, and the final weights, match the
    uninterrupted run's (1e-6: the same operations on the same numbers; any other sample changes
    a reward by 1 and the weights by far more)."""
    env_file = tmp_path / "parity_env.py"
    env_file.write_text(textwrap.dedent(ENV_FILE))
    RLTrainer(resolve(tmp_path, _config(rl_model_dir, prompt_file, env_file, tmp_path / "straight"))).run()

    killed = tmp_path / "killed"
    joined = _config(rl_model_dir, prompt_file, env_file, killed)
    joined.setdefault("placement", {})["ray_address"] = ray_session.get_runtime_context().gcs_address
    spec = write_yaml(tmp_path / "killed.yaml", joined)
    log = tmp_path / "killed.log"  # a file, not a pipe: a full pipe would stop the run before its checkpoint
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "raylign.cli.main", "rl", "--config", str(spec)],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 300
        while not (killed / "checkpoints" / "step_1").exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint of step 1 within 300 s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, with the episodes of later steps running
        proc.wait(timeout=60)
    newest = latest_checkpoint(killed / "checkpoints")
    assert newest is not None
    resumed_at = int(newest.name.split("_")[1])
    assert resumed_at < STEPS and not (killed / "final").exists()  # killed mid-run
    RLTrainer(resolve(tmp_path, _config(rl_model_dir, prompt_file, env_file, killed))).run()

    steps = {name: [r for r in read_metrics(tmp_path / name) if "reward/mean" in r] for name in ("straight", "killed")}
    assert [r["step"] for r in steps["killed"]] == [1, 2, 3]  # once each, however far the killed run had got
    expected = [PER_STEP * N if step == resumed_at + 1 else 0 for step in (1, 2, 3)]
    assert [r["agent/restarted_episodes"] for r in steps["killed"]] == expected
    assert [r["rollout/restarted_groups"] for r in steps["killed"]] == [e / N for e in expected]
    assert [r["agent/restarted_episodes"] for r in steps["straight"]] == [0, 0, 0]
    trajectories = (killed / "trajectories.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in trajectories] == [1, 2, 3]  # one a step, none twice
    for straight, again in zip(steps["straight"], steps["killed"]):
        assert again["reward/mean"] == pytest.approx(straight["reward/mean"], abs=1e-6)
        assert again["policy/policy_loss"] == pytest.approx(straight["policy/policy_loss"], abs=1e-6)
    assert {r["reward/std"] for r in steps["straight"]} != {0.0}  # the rewards tell samples apart
    expected_weights, got = state_dict_of(tmp_path / "straight" / "final"), state_dict_of(killed / "final")
    for name, tensor in expected_weights.items():
        assert torch.allclose(tensor, got[name], atol=1e-6), name


class ListStream:
    """A stream whose groups finish when the test says so (the feed's side of a rollout stream)."""

    def __init__(self) -> None:
        self.submitted: list[tuple[int, Any]] = []  # (prompt index, tag) of every submit, in order
        self.pending: dict[int, Any] = {}  # seq -> tag
        self.resubmitted = 0

    def __len__(self) -> int:
        return len(self.pending)

    def tags(self) -> list[Any]:
        return list(self.pending.values())

    def submit(self, request: Any, sampling: Any, prompt_index: int, tag: Any) -> None:
        self.submitted.append((prompt_index, tag))
        self.pending[tag[0]] = tag

    def finished(self, wait: bool = True) -> list[FinishedGroup]:
        """The group started first of those in flight, one completion by the weights it started under."""
        tag = self.pending.pop(min(self.pending))
        return [FinishedGroup(tag, [SimpleNamespace(weight_version=tag[2], finished_at=0.0)], 0, 0.0, 0.0)]


def _feed(stream: ListStream, positions) -> RolloutFeed:
    prompts = [Prompt(f"p{i}", [i], None, "test", RowRef("test", i)) for i in range(8)]

    def to_samples(completions, prompt, position):
        samples = [make_sample([position], [1]) for _ in completions]
        for sample, completion in zip(samples, completions):
            sample.weight_version = completion.weight_version
        return samples

    return RolloutFeed(stream, prompts, positions, SamplingConfig(n=1), 2, 1, "drop", to_samples, lambda s: None)


def test_a_checkpoint_records_the_groups_in_flight_and_a_resume_starts_them_again_first():
    """Two prompts a step, one update of staleness: groups 0-3 start; step 1 takes 0 and 1; 4 and 5
    start under version 1; group 2 comes back. A checkpoint now holds group 2 as ready and groups 3,
    4 and 5 (prompts 3, 4, 5) as in flight. A feed restored from it starts exactly those again,
    first, under their own start order (their prompt index, which seeds sampling), and nothing else
    (6 started, 2 trained: the bound of 2 + 2 * 2 is full); the next step counts the 3, the one
    after it none."""
    stream = ListStream()
    feed = _feed(stream, itertools.count())
    feed.top_up(0)  # groups 0-3
    feed.take_step(0)  # takes 0, 1 (the stream returns the lowest seq first)
    feed.top_up(1)  # groups 4, 5
    feed._receive(stream.finished(), 1)  # group 2 comes back (as take_step receives groups)
    state = feed.state_dict()
    assert [g.seq for g in state["ready"]] == [2]
    assert state["in_flight"] == [(3, 3), (4, 4), (5, 5)]
    assert (state["started"], state["trained"]) == (6, 2)

    again = ListStream()
    resumed = _feed(again, iter([7, 6]))  # the prompts a restored sampler would give next
    resumed.load_state_dict(state)
    resumed.top_up(1)
    assert again.submitted == [(3, (3, 3, 1)), (4, (4, 4, 1)), (5, (5, 5, 1))]
    assert resumed.state_dict()["in_flight"] == [(3, 3), (4, 4), (5, 5)]  # a checkpoint now records them too
    step = resumed.take_step(1)
    assert [g.seq for g in step.groups] == [2, 3]
    assert step.restarted == 3
    resumed.top_up(2)  # one more step's worth of new groups, new positions
    assert again.submitted[3:] == [(6, (6, 7, 2)), (7, (7, 6, 2))]
    assert resumed.take_step(2).restarted == 0
