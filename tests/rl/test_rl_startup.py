"""Start-up never waits without a limit: actors that fail or never come up end the run with an error
that names them, within the configured time."""

from __future__ import annotations

import functools
import time

import pytest

from raylign.cluster import StartupError, actor_env, start_together, wait_until_ready
from raylign.config.rollout import RolloutConfig
from raylign.rl.trainer import RLTrainer
from tests.rl.rl_helpers import resolve, rl_config_data


def test_starts_run_at_once_and_a_failure_keeps_what_did_start():
    """Three starts that each wait for the other two at a barrier: run one after another, the first would
    wait out the barrier's limit. The one that raises does not hide the two that started."""
    import threading

    barrier = threading.Barrier(3, timeout=30)

    def start(name: str) -> str:
        barrier.wait()
        if name == "engines":
            raise StartupError("engine 0 failed to start: no weights")
        return name

    started, failed = start_together(
        {name: functools.partial(start, name) for name in ("policy", "reference", "engines")}
    )
    assert started == {"policy": "policy", "reference": "reference"}
    assert isinstance(failed, StartupError) and "engine 0" in str(failed)
    assert start_together({"policy": lambda: 1}) == ({"policy": 1}, None)


class Idle:
    def ping(self) -> str:
        return "pong"


def test_actor_environment_never_overrides_ray_authentication(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    env = actor_env({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "x", "FOO": "1"})
    assert env == {
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736",
        "FOO": "1",
    }


def test_actor_environment_passes_on_the_callers_allocator_setting(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "")  # glibc's defaults, as the caller asked
    assert actor_env()["GLIBC_TUNABLES"] == ""
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert actor_env()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


@pytest.mark.slow
def test_worker_that_cannot_reach_the_head_fails_within_the_limit_with_rays_cause(ray_session):
    """The first-run failure: a worker told RAY_AUTH_MODE=disabled while the local head uses tokens
    (Ray's default for a local Ray) never starts. The wait stops at the limit and reports why."""
    ray = ray_session
    if ray._private.worker._global_node is None:
        pytest.skip("needs the local Ray of this test session")
    actor = ray.remote(Idle).options(num_cpus=0, runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}}).remote()
    start = time.monotonic()
    try:
        with pytest.raises(StartupError) as err:
            wait_until_ready({"policy worker rank 0": actor}, timeout_s=20, setting="placement.startup_timeout_s")
    finally:
        ray.kill(actor)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert 20 <= elapsed < 40
    assert "policy worker rank 0" in message and "placement.startup_timeout_s" in message
    assert "PENDING_CREATION" in message
    assert "Unauthenticated" in message or "InvalidAuthToken" in message  # the excerpt of Ray's own log


def test_actor_that_needs_more_than_the_cluster_has_times_out_naming_it(ray_session):
    ray = ray_session
    actor = ray.remote(Idle).options(num_cpus=10_000).remote()
    try:
        with pytest.raises(StartupError, match=r"reward model x: state PENDING_CREATION.*within 3 s|within 3 s"):
            wait_until_ready({"reward model x": actor}, timeout_s=3)
    finally:
        ray.kill(actor)


def test_engine_whose_model_cannot_load_fails_naming_the_engine(ray_session, tmp_path):
    from raylign.rollout.pool import launch_engines

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    start = time.monotonic()
    with pytest.raises(StartupError, match=r"rollout engine 0 \(hf, model .*broken-model\) failed to start"):
        launch_engines(
            broken, RolloutConfig(engine="hf", dtype="float32", num_cpus_per_engine=0), startup_timeout_s=120
        )
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_run_with_a_reward_file_that_raises_at_import_stops_naming_the_file(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    reward_file = tmp_path / "bad_reward.py"
    reward_file.write_text("raise RuntimeError('broken on purpose')\n\ndef reward_func(*a, **k):\n    return []\n")
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run")
    data["reward"] = {"sources": [{"kind": "function", "path": str(reward_file)}]}
    data["placement"] = {"startup_timeout_s": 60}
    cfg = resolve(tmp_path, data)
    start = time.monotonic()
    with pytest.raises(Exception) as err:
        RLTrainer(cfg).run()
    assert time.monotonic() - start < 60
    assert str(reward_file) in str(err.value) and "broken on purpose" in str(err.value)


def test_run_whose_policy_worker_cannot_load_its_model_names_the_worker(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    """The controller reads the tokenizer; the worker then fails to load the weights."""
    import shutil

    model = tmp_path / "no-weights"
    shutil.copytree(rl_model_dir, model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    data = rl_config_data(model, prompt_file, tmp_path / "run")
    # The policy worker is the run's only actor: no engine actor (colocated), no reference (no KL term).
    data["placement"] = {"startup_timeout_s": 120, "colocate": True}
    data["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0}
    cfg = resolve(tmp_path, data)
    with pytest.raises(StartupError, match=r"policy worker rank 0 failed to start: .*"):
        RLTrainer(cfg).run()
