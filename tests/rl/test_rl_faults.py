"""Processes of an RL run killed with SIGKILL: an engine actor (while its groups wait to be
generated, and while the policy trains) and a policy rank.

A dead engine is replaced by a new one holding the current weights, the groups it had are
generated again, and the run ends as an uninterrupted one does; a dead policy rank ends the
run at once with an error naming it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from raylign.cluster import ActorDied
from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import resolve, rl_config_data, state_dict_of


def _pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def _kill(actor) -> None:
    os.kill(_pid(actor), signal.SIGKILL)


def _two_engine_config(model_dir, prompt_file, out):
    data = rl_config_data(model_dir, prompt_file, out)
    data["rollout"]["num_engines"] = 2
    data["train"].update(max_steps=4, export=True)
    # No KL term: its reference would be one more actor in each of the three runs, and nothing here reads it.
    data["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0}
    return data


class EngineKiller(RLTrainer):
    """Kills engine 1 once step 1's weights are synced (its step-2 groups are then lost), and
    engine 0 while step 3 trains (the sync after it finds the engine dead)."""

    def sync_weights(self):
        metrics = super().sync_weights()
        if self.step == 0:  # the sync after step 1
            _kill(self.engines[1])
        return metrics

    def update(self, samples, exp):
        metrics = super().update(samples, exp)
        if self.step == 2:
            _kill(self.engines[0])
        return metrics


def test_dead_engines_are_replaced_and_the_run_ends_as_an_uninterrupted_one(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    RLTrainer(resolve(tmp_path, _two_engine_config(rl_model_dir, prompt_file, tmp_path / "straight"))).run()
    EngineKiller(resolve(tmp_path, _two_engine_config(rl_model_dir, prompt_file, tmp_path / "killed"))).run()

    rows = {name: [r for r in read_metrics(tmp_path / name) if "reward/mean" in r] for name in ("straight", "killed")}
    killed = rows["killed"]
    assert [r["step"] for r in killed] == [1, 2, 3, 4]
    # Engine 1 died with step 2's groups on it (4 groups, routed 0, 1, 0, 1: two of them), engine 0 during
    # step 3's update; each was replaced once.
    assert [r["rollout/engine_restarts"] for r in killed] == [0, 1, 2, 2]
    assert [r["rollout/resubmitted_groups"] for r in killed] == [0, 2, 2, 2]
    assert [r["rollout/engine_restarts"] for r in rows["straight"]] == [0, 0, 0, 0]
    # The new engines sampled with the current weights under the current version: nothing is stale.
    assert all(r["staleness/token_lag_max"] == 0 for r in killed)
    print(f"faults survived: 2 engine kills, {killed[-1]['rollout/resubmitted_groups']:.0f} groups generated again")
    # Seeded sampling: the groups generated again are the ones the dead engine would have made.
    for straight, again in zip(rows["straight"], killed):
        assert again["reward/mean"] == pytest.approx(straight["reward/mean"], abs=1e-6)
        assert again["policy/policy_loss"] == pytest.approx(straight["policy/policy_loss"], abs=1e-6)
    expected, got = state_dict_of(tmp_path / "straight" / "final"), state_dict_of(tmp_path / "killed" / "final")
    for name, tensor in expected.items():
        assert torch.allclose(tensor, got[name], atol=1e-6), name
    # A resumed run goes on counting: rollout.max_engine_restarts bounds the whole run.
    more = _two_engine_config(rl_model_dir, prompt_file, tmp_path / "killed")
    more["train"]["max_steps"] = 5
    RLTrainer(resolve(tmp_path, more)).run()
    (fifth,) = [r for r in read_metrics(tmp_path / "killed") if r["step"] == 5 and "reward/mean" in r]
    assert (fifth["rollout/engine_restarts"], fifth["rollout/resubmitted_groups"]) == (2, 2)


class RankKiller(RLTrainer):
    """Kills policy rank 1 just before step 2's update."""

    killed_at = 0.0

    def update(self, samples, exp):
        if self.step == 1:
            _kill(self.groups["policy"].workers[1])
            RankKiller.killed_at = time.monotonic()
        return super().update(samples, exp)


def test_a_dead_policy_rank_stops_the_run_at_once_naming_it(ray_session, rl_model_dir, prompt_file, tmp_path):
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run")
    data["placement"] = {"policy_workers": 2, "colocate": True}  # the two ranks are the run's only actors
    data["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0}
    data["engine"] = {"backend": "fsdp2"}
    with pytest.raises(ActorDied, match=r"policy workers' train_policy: rank 1 of 2 died") as raised:
        RankKiller(resolve(tmp_path, data)).run()
    stopped_after = time.monotonic() - RankKiller.killed_at  # including the shutdown of every actor
    assert raised.value.name == "rank 1 of 2"
    assert stopped_after < 60, f"the run took {stopped_after:.0f} s to stop after the kill"
    print(f"a killed policy rank stopped the run {stopped_after:.1f} s after the kill: {raised.value}")
