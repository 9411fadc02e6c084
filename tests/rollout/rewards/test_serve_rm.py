"""``raylign serve-rm``: config checks, a reward model behind /score, and a reward file served by a real process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from raylign.cli.serve_rm import ServeRMConfig, build_scorer
from raylign.config.base import ConfigError, parse_config
from raylign.rollout.rewards import HttpRewardSource
from raylign.rollout.rewards.server import create_app


def test_config_needs_exactly_one_scorer_and_defaults_to_loopback():
    with pytest.raises(ConfigError, match="set exactly one of model_path and reward_file"):
        parse_config(ServeRMConfig, {})
    with pytest.raises(ConfigError, match="set exactly one of model_path and reward_file"):
        parse_config(ServeRMConfig, {"model_path": "m", "reward_file": "r.py"})
    assert parse_config(ServeRMConfig, {"model_path": "m"}).host == "127.0.0.1"


def test_serves_a_reward_model_folder(loopback_server, tiny_reward_model_dir, rm_mean_std, reference_rm_scores):
    prompts, responses = ["What is 2 + 2?", "Say hello"], ["4", "hello there"]
    mean, std = rm_mean_std
    expected = [(r - mean) / std for r in reference_rm_scores(tiny_reward_model_dir, prompts, responses)]
    scorer = build_scorer(parse_config(ServeRMConfig, {"model_path": str(tiny_reward_model_dir)}))
    with loopback_server(create_app(scorer, api_key="k")) as server:
        result = HttpRewardSource(server.url, api_key="k", timeout_s=30).score(prompts, responses)
    assert result.rewards == pytest.approx(expected, abs=1e-5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(base: str, process: subprocess.Popen, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"serve-rm exited early:\n{process.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("serve-rm did not come up")


@pytest.mark.slow
def test_run_serve_rm_serves_a_python_reward_file_in_its_own_process(tmp_path):
    reward_file = tmp_path / "score.py"
    reward_file.write_text(
        textwrap.dedent("""
        def reward_func(prompts, responses, labels, **metadata):
            return [1.0 if r.strip() == str(l) else -1.0 for r, l in zip(responses, labels)]
    """)
    )
    port = _free_port()
    code = (
        "from raylign.cli.serve_rm import ServeRMConfig, run_serve_rm; "
        f"run_serve_rm(ServeRMConfig(reward_file={str(reward_file)!r}, port={port}, api_key_env='RM_KEY'))"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", RM_KEY="abc")
    process = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", process)
        source = HttpRewardSource(f"http://127.0.0.1:{port}/score", api_key="abc", timeout_s=30)
        result = source.score(["q1", "q2", "q3"], [" 7 ", "8", "x"], [7, 9, "x"])
        unauthorized = httpx.post(f"http://127.0.0.1:{port}/score", json={"prompts": [], "responses": []})
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert result.rewards == [1.0, -1.0, 1.0]
    assert unauthorized.status_code == 401
