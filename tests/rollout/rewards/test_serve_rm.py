"""``raylign serve-rm``: config checks, a reward model behind /score, and a reward file served by a real process."""

from __future__ import annotations

import math
import socket
import textwrap

import httpx
import pytest
import torch

from raylign.cli.serve_rm import ServeRMConfig, build_scorer, listening_socket, score_url
from raylign.config.base import ConfigError, parse_config
from raylign.models.heads import HEAD_NAME
from raylign.rollout.rewards import HttpRewardSource, RewardError
from raylign.rollout.rewards.server import create_app

from .test_serve_rm_load import serving_port, spawn_serve_rm


def test_config_needs_exactly_one_scorer_and_defaults_to_loopback():
    with pytest.raises(ConfigError, match="set exactly one of model_path and reward_file"):
        parse_config(ServeRMConfig, {})
    with pytest.raises(ConfigError, match="set exactly one of model_path and reward_file"):
        parse_config(ServeRMConfig, {"model_path": "m", "reward_file": "r.py"})
    assert parse_config(ServeRMConfig, {"model_path": "m"}).host == "127.0.0.1"

    # Another scorer's options are refused, not ignored (a timeout_s does not bound a model's scoring).
    with pytest.raises(ConfigError, match=r"timeout_s is for reward_file, not model_path"):
        parse_config(ServeRMConfig, {"model_path": "m", "timeout_s": 5.0})
    with pytest.raises(ConfigError, match=r"batch_size, dtype are for model_path, not reward_file"):
        parse_config(ServeRMConfig, {"reward_file": "r.py", "batch_size": 2, "dtype": "bfloat16"})
    # A dumped config lists every field at its default: accepted.
    dumped = parse_config(ServeRMConfig, {"model_path": "m"}).model_dump()
    assert parse_config(ServeRMConfig, dumped).model_path == "m"


def test_serves_a_reward_model_folder(loopback_server, tiny_reward_model_dir, rm_mean_std, reference_rm_scores):
    prompts, responses = ["What is 2 + 2?", "Say hello"], ["4", "hello there"]
    mean, std = rm_mean_std
    expected = [(r - mean) / std for r in reference_rm_scores(tiny_reward_model_dir, prompts, responses)]
    scorer = build_scorer(parse_config(ServeRMConfig, {"model_path": str(tiny_reward_model_dir)}))
    with loopback_server(create_app(scorer, api_key="k")) as server:
        result = HttpRewardSource(server.url, api_key="k", timeout_s=30).score(prompts, responses)
    assert result.rewards == pytest.approx(expected, abs=1e-5)


def test_a_sample_the_model_cannot_score_is_422_naming_it_and_the_client_does_not_retry(
    loopback_server, tiny_reward_model_dir
):
    scorer = build_scorer(parse_config(ServeRMConfig, {"model_path": str(tiny_reward_model_dir)}))
    with torch.no_grad():  # +inf and -inf terms in every score: NaN, as an overflowing head gives
        getattr(scorer.scorer.model, HEAD_NAME).weight.fill_(float("inf"))
    app = create_app(scorer)
    requests: list[int] = []

    @app.middleware("http")
    async def count_requests(request, call_next):
        requests.append(1)
        return await call_next(request)

    cause = (
        f"reward model {tiny_reward_model_dir}: rewards: value for sample 0 (prompt 'What is 2 + 2?') "
        "is not a finite number: nan"
    )
    with loopback_server(app) as server:
        raw = httpx.post(server.url, json={"prompts": ["What is 2 + 2?"], "responses": ["4"]}, timeout=30)
        with pytest.raises(RewardError) as caught:
            HttpRewardSource(server.url, timeout_s=30, max_retries=3, backoff_s=0.5).score(["What is 2 + 2?"], ["4"])
    assert (raw.status_code, raw.json()) == (422, {"detail": cause})
    assert len(requests) == 2  # the raw request and one from the client, not 1 + 3 retries
    assert str(caught.value) == (
        f"HTTP reward source {server.url} failed on 1 sample starting at sample 0 (prompt 'What is 2 + 2?'): "
        f"the server answered 422, which a retry would repeat: {cause}"
    )


def test_under_non_finite_drop_the_client_gets_the_nan_to_drop_its_group(loopback_server, tiny_reward_model_dir):
    # reward.non_finite: drop sets keep_non_finite on every source; the server still answered 422, so one
    # NaN stopped the run where a local source's group would be dropped.
    scorer = build_scorer(parse_config(ServeRMConfig, {"model_path": str(tiny_reward_model_dir), "normalize": False}))
    healthy = scorer.score(["Say hello"], ["hello"]).rewards[0]
    with torch.no_grad():
        getattr(scorer.scorer.model, HEAD_NAME).weight.fill_(float("inf"))
    with loopback_server(create_app(scorer)) as server:
        source = HttpRewardSource(server.url, timeout_s=30)
        source.keep_non_finite = True
        result = source.score(["What is 2 + 2?"], ["4"])
        assert len(result.rewards) == 1 and math.isnan(result.rewards[0])
        source.keep_non_finite = False  # the next request, without the header: refused as before
        with pytest.raises(RewardError, match="the server answered 422"):
            source.score(["What is 2 + 2?"], ["4"])
    assert math.isfinite(healthy)


@pytest.mark.slow
def test_run_serve_rm_serves_a_python_reward_file_in_its_own_process(tmp_path):
    reward_file = tmp_path / "score.py"
    reward_file.write_text(
        textwrap.dedent("""
        def reward_func(prompts, responses, labels, **metadata):
            return [1.0 if r.strip() == str(l) else -1.0 for r, l in zip(responses, labels)]
    """)
    )
    process = spawn_serve_rm(tmp_path, reward_file, "--api_key_env", "RM_KEY", RM_KEY="abc")
    try:
        port = serving_port(tmp_path, process)
        source = HttpRewardSource(f"http://127.0.0.1:{port}/score", api_key="abc", timeout_s=30)
        result = source.score(["q1", "q2", "q3"], [" 7 ", "8", "x"], [7, 9, "x"])
        unauthorized = httpx.post(f"http://127.0.0.1:{port}/score", json={"prompts": [], "responses": []})
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert result.rewards == [1.0, -1.0, 1.0]
    assert unauthorized.status_code == 401


def test_a_port_another_process_holds_is_refused_by_name_before_anything_loads():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=rf"cannot listen on 127\.0\.0\.1:{port}: .*--port 0 for a free one"):
            listening_socket("127.0.0.1", port)


def test_port_0_binds_a_port_the_os_picks_and_the_url_names_it():
    with listening_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        assert score_url(sock) == f"http://127.0.0.1:{port}/score"
    with listening_socket("::1", 0) as sock:
        assert score_url(sock) == f"http://[::1]:{sock.getsockname()[1]}/score"
