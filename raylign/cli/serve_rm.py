"""``raylign serve-rm``: serve a reward model folder or a Python reward file over HTTP.

Clients (the ``http`` reward source) ``POST /score`` with prompts, responses and labels and get
one reward per sample; see :mod:`raylign.rollout.rewards.server` for the protocol.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from typing import Literal

from pydantic import Field, model_validator

from raylign.config.base import Section

log = logging.getLogger("raylign")


class ServeRMConfig(Section):
    """raylign serve-rm: serve a reward model or a Python reward function on POST /score (loopback by default)."""

    model_path: str | None = Field(
        None, description="Folder of a one-label AutoModelForSequenceClassification model (e.g. from raylign rm)."
    )
    reward_file: str | None = Field(
        None, description="Python file defining a batched reward function (instead of model_path)."
    )
    function_name: str = Field("reward_func", min_length=1, description="Function to call in reward_file.")
    num_workers: int = Field(1, ge=1, le=256, description="Worker processes for reward_file.")
    timeout_s: float = Field(60.0, gt=0, description="Seconds one reward_file call may take.")
    batch_size: int = Field(16, ge=1, description="Samples per forward pass of the model.")
    normalize: bool = Field(
        True, description="Return (score - mean) / std with raylign_reward_mean / raylign_reward_std from config.json."
    )
    max_length: int | None = Field(None, ge=8, description="Keep at most this many tokens (the end); None keeps all.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Model parameter dtype.")
    host: str = Field("127.0.0.1", min_length=1,
                      description="Address to listen on; anything but loopback exposes the server to the network.")
    port: int = Field(8000, ge=1, le=65535, description="TCP port.")
    api_key: str | None = Field(None, description="Require 'Authorization: Bearer <key>' on /score.")
    api_key_env: str | None = Field(
        None, min_length=1, description="Environment variable holding the API key (used when api_key is not set)."
    )
    max_request_bytes: int = Field(16 * 2**20, ge=1024, description="Larger request bodies are refused with 413.")

    @model_validator(mode="after")
    def _one_scorer(self) -> "ServeRMConfig":
        if (self.model_path is None) == (self.reward_file is None):
            raise ValueError("set exactly one of model_path and reward_file")
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _api_key(cfg: ServeRMConfig) -> str | None:
    if cfg.api_key is not None or cfg.api_key_env is None:
        return cfg.api_key
    value = os.environ.get(cfg.api_key_env)
    if not value:
        raise ValueError(f"api_key_env names {cfg.api_key_env}, but that environment variable is not set")
    return value


def build_scorer(cfg: ServeRMConfig):
    """The reward source the server answers with: a local reward model or a Python reward file."""
    if cfg.model_path is not None:
        from raylign.rollout.rewards.reward_model import LocalRewardModel

        return LocalRewardModel(cfg.model_path, batch_size=cfg.batch_size, normalize=cfg.normalize,
                                max_length=cfg.max_length, dtype=cfg.dtype)
    from raylign.rollout.rewards.function import PythonFileReward

    return PythonFileReward(cfg.reward_file, cfg.function_name, num_workers=cfg.num_workers, timeout_s=cfg.timeout_s)


def run_serve_rm(cfg: ServeRMConfig) -> None:
    """Load the scorer and serve it with uvicorn until interrupted."""
    import uvicorn

    from raylign.rollout.rewards.server import create_app

    api_key = _api_key(cfg)
    if not _is_loopback(cfg.host):
        log.warning("serving on %s: reachable from the network%s", cfg.host,
                    "" if api_key else " and without an API key (set api_key or api_key_env)")
    scorer = build_scorer(cfg)
    try:
        app = create_app(scorer, api_key=api_key, max_request_bytes=cfg.max_request_bytes)
        log.info("serving %s on http://%s:%d/score", scorer.description, cfg.host, cfg.port)
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
    finally:
        scorer.close()
