"""``raylign serve-rm``: serve a reward model folder or a Python reward file over HTTP.

Clients (the ``http`` reward source) ``POST /score`` with prompts, responses and labels and get
one reward per sample; see :mod:`raylign.rollout.rewards.server` for the protocol.

SIGTERM or Ctrl+C stops the server gracefully: it stops accepting connections, finishes the
requests in flight for up to ``shutdown_grace_s`` seconds, cuts the rest (logged), closes the
scorer and exits with code 0. A second Ctrl+C cuts the requests at once. SIGTERM while the
scorer is still loading stops what was started and exits with code 143.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from raylign.config.base import Section

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

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
    max_length: int | None = Field(
        None,
        ge=8,
        description="Keep at most this many tokens: the end (and an encoder classifier's first token); None keeps all.",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Model parameter dtype.")
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address to listen on; anything but loopback exposes the server to the network.",
    )
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one, named in the log.")
    api_key: str | None = Field(None, description="Require 'Authorization: Bearer <key>' on /score.")
    api_key_env: str | None = Field(
        None, min_length=1, description="Environment variable holding the API key (used when api_key is not set)."
    )
    max_request_bytes: int = Field(16 * 2**20, ge=1024, description="Larger request bodies are refused with 413.")
    # 20 s: inside the 30 s that Kubernetes waits after SIGTERM before it kills a pod.
    shutdown_grace_s: float = Field(
        20.0,
        gt=0,
        description="On SIGTERM or Ctrl+C, seconds to finish the requests in flight (no new connections "
        "are accepted); the requests still unanswered then are cut (their clients get a 500).",
    )

    @model_validator(mode="after")
    def _one_scorer(self) -> ServeRMConfig:
        if (self.model_path is None) == (self.reward_file is None):
            raise ValueError("set exactly one of model_path and reward_file")
        scorer, other = ("model_path", "reward_file") if self.model_path is not None else ("reward_file", "model_path")
        foreign = self.set_away_from_default(SCORER_FIELDS[other])
        if foreign:
            raise ValueError(f"{', '.join(foreign)} {'is' if len(foreign) == 1 else 'are'} for {other}, not {scorer}")
        return self


# The options each kind of scorer reads; the other's are refused rather than ignored.
SCORER_FIELDS = {
    "model_path": ("batch_size", "normalize", "max_length", "dtype"),
    "reward_file": ("function_name", "num_workers", "timeout_s"),
}


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

        return LocalRewardModel(
            cfg.model_path,
            batch_size=cfg.batch_size,
            normalize=cfg.normalize,
            max_length=cfg.max_length,
            dtype=cfg.dtype,
        )
    from raylign.rollout.rewards.function import PythonFileReward

    assert cfg.reward_file is not None  # the config holds a reward model or a reward file
    return PythonFileReward(cfg.reward_file, cfg.function_name, num_workers=cfg.num_workers, timeout_s=cfg.timeout_s)


def uvicorn_server(app: FastAPI, host: str, port: int, shutdown_grace_s: float) -> uvicorn.Server:
    """The uvicorn server that serve-rm runs ``app`` with (port 0: a free port, read from ``server.servers``)."""
    import uvicorn

    return uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=shutdown_grace_s)  # type: ignore[arg-type]
    )


@contextlib.contextmanager
def stop_signals_end_serving(server: uvicorn.Server) -> Iterator[None]:
    """SIGINT and SIGTERM stop ``server`` and are then done with, so that serve-rm returns normally.

    uvicorn handles both while it serves (a graceful shutdown), then raises the signal again for
    the handler that was there before: by default SIGTERM would kill the process at that point,
    before the scorer is closed (a reward file's worker processes would be left running).
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return

    def stop(signum: int, frame: object) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def sigterm_ends_start_up() -> Iterator[None]:
    """SIGTERM while the scorer loads ends serve-rm at once, but through Python's exit (status
    143), so that what was started is stopped (a reward file's worker processes); by default
    SIGTERM would kill the process and leave them running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` for the server; port 0 binds one the OS picks.

    Bound before the scorer loads, so that a port another process holds is reported at once, and
    so that the log names the port a client should use when the OS picked it.
    """
    from raylign.sockets import bound_socket

    try:
        return bound_socket(host, port)
    except OSError as err:
        raise ValueError(
            f"serve-rm cannot listen on {host}:{port}: {err.strerror or err}. Choose another port "
            "(--port), or --port 0 for a free one that the log then names"
        ) from err


def serve_until_stopped(app: FastAPI, cfg: ServeRMConfig, sock: socket.socket) -> None:
    """Serve ``app`` on ``sock`` until SIGTERM or Ctrl+C, then finish the requests in flight within
    the grace period."""
    server = uvicorn_server(app, cfg.host, sock.getsockname()[1], cfg.shutdown_grace_s)
    with stop_signals_end_serving(server):
        server.run(sockets=[sock])
    cut = app.state.scoring.requests_cut
    if cut:
        log.warning(
            "shutdown: %d request(s) still in flight after shutdown_grace_s=%g s were cut (their clients "
            "got a 500); a scoring call in progress is let finish before the scorer closes",
            cut,
            cfg.shutdown_grace_s,
        )
    log.info("serve-rm stopped")


def run_serve_rm(cfg: ServeRMConfig) -> None:
    """Load the scorer and serve it with uvicorn until SIGTERM or Ctrl+C (see the module docstring)."""
    from raylign.rollout.rewards.server import create_app

    api_key = _api_key(cfg)
    if not _is_loopback(cfg.host):
        log.warning(
            "serving on %s: reachable from the network%s",
            cfg.host,
            "" if api_key else " and without an API key (set api_key or api_key_env)",
        )
    with listening_socket(cfg.host, cfg.port) as sock:
        with sigterm_ends_start_up():
            scorer = build_scorer(cfg)
            try:
                app = create_app(scorer, api_key=api_key, max_request_bytes=cfg.max_request_bytes)
            except BaseException:
                scorer.close()
                raise
        try:
            log.info("serving %s on %s", scorer.description, score_url(sock))
            serve_until_stopped(app, cfg, sock)
        finally:
            app.state.scoring.close_scorer()


def score_url(sock: socket.socket) -> str:
    """The ``/score`` address of the server listening on ``sock``."""
    from raylign.sockets import http_url

    host, port = sock.getsockname()[:2]
    return http_url(host, port, "/score")
