"""HTTP reward source against real uvicorn servers on 127.0.0.1: rewards, retries, and clear failures."""

from __future__ import annotations

import asyncio
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from raylign.rollout.rewards import ExactMatchReward, HttpRewardSource, RewardError, RewardResult, RewardSource
from raylign.rollout.rewards.remote import backoff_delay
from raylign.rollout.rewards.server import create_app

PROMPTS = ["Capital of France?", "Capital of Peru?"]
RESPONSES = ["Paris", "Quito"]
LABELS = ["Paris", "Lima"]


class FailingScorer(RewardSource):
    """Counts its calls and always raises ``error``: a RewardError as a scorer that cannot score the
    batch raises, another exception as a fault of the server would."""

    description = "failing scorer"

    def __init__(self, error: Exception):
        self.error = error
        self.calls = 0

    def _score(self, prompts, responses, labels, metadata) -> RewardResult:
        self.calls += 1
        raise self.error


def misbehaving_app(mode: str, attempts: list[int], release: threading.Event) -> FastAPI:
    """A server that counts requests and then stalls, sends broken JSON, or the wrong number of rewards."""
    app = FastAPI()

    @app.post("/score")
    async def score(request: Request) -> Any:
        attempts.append(1)
        n = len((await request.json())["prompts"])
        if mode == "stall":
            while not release.is_set():  # until the test ends, far past the client's timeout
                await asyncio.sleep(0.05)
            return {"rewards": [0.0] * n}
        if mode == "malformed":
            return Response('{"rewards": [1.0, ', media_type="application/json")
        if mode == "short":
            return {"rewards": [1.0] * (n - 1)}
        raise AssertionError(mode)

    return app


def client(url: str, **kwargs) -> HttpRewardSource:
    settings = {"timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.01} | kwargs
    return HttpRewardSource(url, **settings)


def test_good_server_returns_the_scorers_rewards(loopback_server):
    with loopback_server(create_app(ExactMatchReward())) as server:
        source = client(server.url, batch_size=1)  # two requests of one sample
        result = source.score(PROMPTS, RESPONSES, LABELS)
    assert result.rewards == [1.0, 0.0]


def test_a_batch_the_scorer_cannot_score_is_422_and_not_retried(loopback_server):
    cause = "reward function 'score' failed on sample 1 (prompt 'Capital of Peru?'): KeyError: 'Lima'"
    scorer = FailingScorer(RewardError(cause))
    with loopback_server(create_app(scorer)) as server:
        raw = httpx.post(server.url, json={"prompts": PROMPTS, "responses": RESPONSES})
        assert (raw.status_code, raw.json()) == (422, {"detail": cause})
        scorer.calls = 0
        with pytest.raises(RewardError) as caught:
            client(server.url, max_retries=3).score(PROMPTS, RESPONSES, LABELS)
    assert scorer.calls == 1
    assert str(caught.value) == (
        f"HTTP reward source {server.url} failed on 2 samples starting at sample 0 (prompt 'Capital of France?'): "
        f"the server answered 422, which a retry would repeat: {cause}"
    )


def test_a_fault_of_the_server_is_500_and_retried_then_error_names_batch_and_cause(loopback_server):
    scorer = FailingScorer(RuntimeError("CUDA out of memory"))
    with loopback_server(create_app(scorer)) as server, pytest.raises(RewardError) as caught:
        client(server.url, max_retries=2).score(PROMPTS, RESPONSES, LABELS)
    assert scorer.calls == 3  # first try + 2 retries
    assert str(caught.value) == (
        f"HTTP reward source {server.url} failed on 2 samples starting at sample 0 (prompt 'Capital of France?') "
        "after 3 attempts; last cause: the server answered 500: RuntimeError: CUDA out of memory"
    )


def status_app(status: int, detail: str, attempts: list[int]) -> FastAPI:
    """A server that counts requests and answers each with ``status`` and ``{"detail": detail}``."""
    app = FastAPI()

    @app.post("/score")
    async def score(request: Request) -> Any:
        attempts.append(1)
        return JSONResponse({"detail": detail}, status_code=status)

    return app


RETRIED = "after 3 attempts; last cause: the server answered {status}: busy or broken"
NOT_RETRIED = "the server answered {status}, which a retry would repeat: busy or broken"


@pytest.mark.parametrize(
    ("status", "attempts_expected", "ending"),
    [(status, 1, NOT_RETRIED) for status in (400, 404, 422, 501, 505)]
    + [(status, 3, RETRIED) for status in (408, 429, 500, 502, 503, 504)],
)
def test_only_answers_that_a_retry_may_change_are_retried(loopback_server, status, attempts_expected, ending):
    attempts: list[int] = []
    with (
        loopback_server(status_app(status, "busy or broken", attempts)) as server,
        pytest.raises(RewardError) as caught,
    ):
        client(server.url, max_retries=2).score(PROMPTS, RESPONSES, LABELS)
    assert len(attempts) == attempts_expected
    assert str(caught.value).endswith(ending.format(status=status))


def test_the_servers_message_is_quoted_whole_not_its_first_200_characters(loopback_server):
    detail = (
        "reward function 'reward_func' in /srv/rewards/" + "nested/" * 20 + "score.py failed on 1 sample starting "
        "at sample 1 (prompt 'Capital of Peru?'): ValueError: invalid literal for int() with base 10: 'Quito'"
    )
    assert len(detail) > 250
    with loopback_server(status_app(422, detail, [])) as server, pytest.raises(RewardError) as caught:
        client(server.url).score(PROMPTS, RESPONSES, LABELS)
    assert str(caught.value).endswith(f"the server answered 422, which a retry would repeat: {detail}")


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("stall", r"no complete answer within timeout_s=0\.5 s"),
        ("malformed", r"not valid JSON"),
        ("short", r"the answer has 1 rewards for 2 samples"),
    ],
)
def test_misbehaving_server_is_retried_then_error_names_batch_and_cause(loopback_server, mode, cause):
    attempts: list[int] = []
    release = threading.Event()
    with loopback_server(misbehaving_app(mode, attempts, release)) as server:
        try:
            with pytest.raises(
                RewardError,
                match=rf"2 samples starting at sample 0 \(prompt 'Capital of France\?'\) "
                rf"after 2 attempts; last cause: .*{cause}",
            ):
                client(server.url, max_retries=1, timeout_s=0.5).score(PROMPTS, RESPONSES, LABELS)
        finally:
            release.set()
    assert len(attempts) == 2


def test_retries_back_off_exponentially(loopback_server):
    assert [backoff_delay(k, 0.5) for k in (1, 2, 3)] == [0.5, 1.0, 2.0]
    attempts: list[int] = []
    with loopback_server(misbehaving_app("malformed", attempts, threading.Event())) as server:
        started = time.monotonic()
        with pytest.raises(RewardError):
            client(server.url, max_retries=3, backoff_s=0.1).score(PROMPTS, RESPONSES, LABELS)
        elapsed = time.monotonic() - started
    assert len(attempts) == 4
    assert elapsed >= 0.1 + 0.2 + 0.4


def test_wrong_api_key_is_401_and_not_retried(loopback_server):
    app = create_app(ExactMatchReward(), api_key="s3cret")
    requests: list[str] = []

    @app.middleware("http")
    async def count_requests(request, call_next):
        requests.append(request.headers.get("authorization", ""))
        return await call_next(request)

    with loopback_server(app) as server:
        with pytest.raises(RewardError, match=r"refused the API key \(401 Unauthorized.*check api_key"):
            client(server.url, api_key="wrong", max_retries=3).score(PROMPTS, RESPONSES, LABELS)
        assert requests == ["Bearer wrong"]  # one request: a wrong key is not retried
        no_header = httpx.post(server.url, json={"prompts": PROMPTS, "responses": RESPONSES})
        assert no_header.status_code == 401
        good = client(server.url, api_key="s3cret").score(PROMPTS, RESPONSES, LABELS)
    assert good.rewards == [1.0, 0.0]


def test_oversize_request_is_413_with_a_hint(loopback_server):
    with loopback_server(create_app(ExactMatchReward(), max_request_bytes=2048)) as server:
        big = ["x" * 3000, "y"]
        with pytest.raises(RewardError, match=r"larger than the server accepts \(413.*lower batch_size"):
            client(server.url).score(PROMPTS, big, LABELS)
        raw = httpx.post(server.url, json={"prompts": PROMPTS, "responses": big})
        assert raw.status_code == 413
        # the same data in requests of one short sample each fits
        assert client(server.url, batch_size=1).score(PROMPTS, RESPONSES, LABELS).rewards == [1.0, 0.0]


def test_malformed_request_is_422_naming_the_field(loopback_server):
    with loopback_server(create_app(ExactMatchReward())) as server:
        answer = httpx.post(server.url, json={"prompts": PROMPTS})
    assert answer.status_code == 422 and "responses" in answer.json()["detail"]


def test_unreachable_server_is_retried_then_reported(unused_loopback_url):
    with pytest.raises(RewardError, match=r"after 3 attempts; last cause: connection failed"):
        client(unused_loopback_url, max_retries=2).score(PROMPTS, RESPONSES, LABELS)


def test_labels_that_are_not_json_name_the_batch():
    with pytest.raises(RewardError, match=r"cannot be sent as JSON"):
        client("http://127.0.0.1:9/score").score(PROMPTS, RESPONSES, [object(), None])


def test_a_server_answering_nan_is_an_error_unless_non_finite_rewards_are_kept(loopback_server):
    import math

    app = FastAPI()

    @app.post("/score")
    async def score(request: Request) -> Any:
        n = len((await request.json())["prompts"])
        return Response('{"rewards": [NaN' + ", 1.0" * (n - 1) + "]}", media_type="application/json")

    with loopback_server(app) as server:
        with pytest.raises(RewardError, match=r"rewards value nan \(position 0\) in the answer is not a finite number"):
            client(server.url, max_retries=0).score(PROMPTS, RESPONSES, LABELS)
        keeping = client(server.url, max_retries=0)
        keeping.keep_non_finite = True
        result = keeping.score(PROMPTS, RESPONSES, LABELS)
    assert math.isnan(result.rewards[0]) and result.rewards[1] == 1.0


# ---- timeout_s bounds a request in all ------------------------------------------------------------

TRICKLE_INTERVAL_S = 0.05
TRICKLED_ANSWER = b'{"rewards": [1.0, 0.0]}' + b" " * 80


class TrickleHandler(socketserver.BaseRequestHandler):
    """Reads a request, then sends a valid answer one byte every TRICKLE_INTERVAL_S: the status line
    and headers too (``trickle = "headers"``) or only the body (``"body"``). Each read of the client
    gets a byte well within its timeout; the whole answer takes over 5 s."""

    trickle = "body"
    requests: list[float] = []

    def handle(self) -> None:
        received = b""
        while b"\r\n\r\n" not in received:  # the request's headers; its body is not needed
            chunk = self.request.recv(65536)
            if not chunk:
                return
            received += chunk
        type(self).requests.append(time.monotonic())
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(TRICKLED_ANSWER)
        try:
            if self.trickle == "body":
                self.request.sendall(head)
            for byte in (head if self.trickle == "headers" else b"") + TRICKLED_ANSWER:
                self.request.sendall(bytes([byte]))
                time.sleep(TRICKLE_INTERVAL_S)
        except OSError:  # the client has given up and closed the connection
            pass


@contextmanager
def trickling_server(trickle: str) -> Iterator[tuple[str, list[float]]]:
    """(url, the times requests arrived) of a TrickleHandler server on 127.0.0.1."""
    handler = type("Handler", (TrickleHandler,), {"trickle": trickle, "requests": []})
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", handler.requests
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("trickle", ["headers", "body"])
def test_a_server_sending_a_byte_at_a_time_is_cut_off_at_timeout_s(trickle):
    timeout_s, backoff_s = 0.5, 0.01
    with trickling_server(trickle) as (url, requests), pytest.raises(RewardError) as caught:
        source = client(url, timeout_s=timeout_s, max_retries=1, backoff_s=backoff_s)
        started = time.monotonic()
        try:
            source.score(PROMPTS, RESPONSES, LABELS)
        finally:
            elapsed = time.monotonic() - started
            source.close()
    assert len(requests) == 2  # the first try and one retry
    assert 2 * timeout_s <= elapsed < 2 * timeout_s + backoff_s + 1.0
    assert str(caught.value) == (
        f"HTTP reward source {url} failed on 2 samples starting at sample 0 (prompt 'Capital of France?') "
        "after 2 attempts; last cause: no complete answer within timeout_s=0.5 s"
    )
