"""``raylign serve-rm`` under load: concurrent clients each get their own rewards, bad requests
amid the load are refused without disturbing it, and SIGTERM finishes the requests in flight.

The load runs against the uvicorn server serve-rm builds (``uvicorn_server``), in a thread,
with the exact-match reward; the shutdown tests run the real ``raylign serve-rm`` process with a
reward file whose calls sleep. Every wait has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from raylign.cli.serve_rm import uvicorn_server
from raylign.rollout.rewards import ExactMatchReward
from raylign.rollout.rewards.server import create_app

API_KEY = "load-test-key"
AUTHORIZED = {"Authorization": f"Bearer {API_KEY}"}
CLIENTS = 16
REQUESTS_PER_CLIENT = 25
SAMPLES_PER_REQUEST = 10  # 2**10 reward patterns: every request of the run has its own
MAX_REQUEST_BYTES = 4096
CLIENT_TIMEOUT = httpx.Timeout(10.0)


# ---- the load -------------------------------------------------------------------------------------


def good_request(client: int, number: int) -> tuple[dict, list[float]]:
    """A batch whose expected rewards spell the binary digits of a number unique to (client, request).

    Sample k matches its label (up to whitespace, 1.0) when digit k is 1, else it differs (0.0); an
    answer meant for any other request of the run has another pattern.
    """
    request_id = client * REQUESTS_PER_CLIENT + number + 1
    digits = [(request_id >> k) & 1 for k in range(SAMPLES_PER_REQUEST)]
    labels = [f"answer {client}-{number}-{k}" for k in range(SAMPLES_PER_REQUEST)]
    responses = [f"  {label}\n" if digit else f"{label}?" for label, digit in zip(labels, digits)]
    prompts = [f"client {client} request {number} sample {k}" for k in range(SAMPLES_PER_REQUEST)]
    body = {"prompts": prompts, "responses": responses, "labels": labels}
    return body, [float(d) for d in digits]


# name -> (headers, body as bytes, the status the server must answer)
BAD_REQUESTS = {
    "oversized": (AUTHORIZED, json.dumps({"prompts": ["p"], "responses": ["x" * 2 * MAX_REQUEST_BYTES]}).encode(), 413),
    "missing field": (AUTHORIZED, b'{"prompts": ["p"]}', 422),
    "not JSON": (AUTHORIZED, b'{"prompts": ["p"], "responses": [', 422),
    "no API key": ({}, b'{"prompts": ["p"], "responses": ["r"]}', 401),
    "wrong API key": ({"Authorization": "Bearer guess"}, b'{"prompts": ["p"], "responses": ["r"]}', 401),
}


class LoadReport:
    """What the clients saw: latencies of good requests (s) and every wrong answer, described."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.bad_answered: dict[str, int] = {}
        self.errors: list[str] = []

    def summary(self, wall_s: float) -> str:
        ms = sorted(1000 * t for t in self.latencies)
        p50, p99 = statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))]
        return (
            f"serve-rm load, {CLIENTS} clients x {REQUESTS_PER_CLIENT} requests of {SAMPLES_PER_REQUEST} "
            f"samples: {len(ms) / wall_s:.0f} good requests/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
            f"{sum(self.bad_answered.values())} bad requests refused, {len(self.errors)} errors"
        )


def run_client(url: str, client: int, report: LoadReport, bad_every: int | None) -> None:
    """REQUESTS_PER_CLIENT good requests on one connection; every ``bad_every``-th is preceded by a bad one."""
    bad_names = list(BAD_REQUESTS)
    with httpx.Client(timeout=CLIENT_TIMEOUT) as http:
        for number in range(REQUESTS_PER_CLIENT):
            if bad_every and number % bad_every == 1:
                name = bad_names[(client + number) % len(bad_names)]
                headers, content, status = BAD_REQUESTS[name]
                try:
                    answer = http.post(url, content=content, headers={"Content-Type": "application/json"} | headers)
                    outcome = answer.status_code
                except httpx.HTTPError as err:
                    outcome = repr(err)
                with report.lock:
                    if outcome == status:
                        report.bad_answered[name] = report.bad_answered.get(name, 0) + 1
                    else:
                        report.errors.append(f"client {client}: {name} request answered {outcome}, not {status}")
            body, expected = good_request(client, number)
            started = time.perf_counter()
            try:
                answer = http.post(url, json=body, headers=AUTHORIZED)
                latency = time.perf_counter() - started
                rewards = answer.json().get("rewards") if answer.status_code == 200 else answer.text[:200]
            except (httpx.HTTPError, ValueError) as err:
                latency, rewards = None, repr(err)
            with report.lock:
                if rewards == expected:
                    report.latencies.append(latency)
                else:
                    report.errors.append(f"client {client} request {number}: expected {expected}, got {rewards}")


def run_load(url: str, bad_every: int | None = None) -> tuple[LoadReport, float]:
    report = LoadReport()
    threads = [
        threading.Thread(target=run_client, args=(url, c, report, bad_every), daemon=True) for c in range(CLIENTS)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    deadline = started + 60
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.perf_counter()))
    assert not any(t.is_alive() for t in threads), "clients still running after 60 s"
    return report, time.perf_counter() - started


@pytest.fixture
def exact_match_server():
    """serve-rm's uvicorn server for the exact-match reward, in a thread on a free port; yields /score's URL."""
    app = create_app(ExactMatchReward(), api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES)
    server = uvicorn_server(app, "127.0.0.1", 0, shutdown_grace_s=5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/score"
    server.should_exit = True
    thread.join(timeout=10)
    assert not thread.is_alive(), "the server did not stop"


@pytest.mark.timeout(90)
def test_concurrent_clients_each_get_the_rewards_of_their_own_requests(exact_match_server, capsys):
    report, wall_s = run_load(exact_match_server)
    with capsys.disabled():
        print(f"\n{report.summary(wall_s)}")
    assert report.errors == []
    assert len(report.latencies) == CLIENTS * REQUESTS_PER_CLIENT


@pytest.mark.timeout(90)
def test_bad_requests_amid_the_load_are_refused_and_good_ones_still_answered(exact_match_server, capsys):
    report, wall_s = run_load(exact_match_server, bad_every=4)  # a bad request before requests 1, 5, 9, ...
    with capsys.disabled():
        print(f"\n{report.summary(wall_s)} (with bad requests: {report.bad_answered})")
    assert report.errors == []
    assert set(report.bad_answered) == set(BAD_REQUESTS)
    assert sum(report.bad_answered.values()) == CLIENTS * len(range(1, REQUESTS_PER_CLIENT, 4))
    body, expected = good_request(CLIENTS + 1, 0)
    after = httpx.post(exact_match_server, json=body, headers=AUTHORIZED, timeout=CLIENT_TIMEOUT)
    assert after.status_code == 200 and after.json()["rewards"] == expected


# ---- graceful shutdown of the real process ------------------------------------------------------------


def write_sleeping_reward_file(tmp_path: Path, sleep_s: float) -> Path:
    """A reward file: reward = length of each response, after ``sleep_s``; each call appends
    "<worker pid> <first response>" to calls.txt before it sleeps."""
    path = tmp_path / "slow_reward.py"
    path.write_text(
        textwrap.dedent(f"""
        import os, time

        def reward_func(prompts, responses, labels, **metadata):
            with open({str(tmp_path / "calls.txt")!r}, "a") as calls:
                calls.write(f"{{os.getpid()}} {{responses[0]}}\\n")
            time.sleep({sleep_s})
            return [float(len(r)) for r in responses]
    """)
    )
    return path


def spawn_serve_rm(tmp_path: Path, reward_file: Path, *options: str, **env: str) -> subprocess.Popen:
    """``raylign serve-rm --reward_file reward_file --port 0 *options``, its output in tmp_path/serve_rm.log.

    Port 0: the server binds a port the OS picks and logs it (:func:`serving_port`); a free port found
    here and bound by the server seconds later could be taken by another process in between."""
    log = open(tmp_path / "serve_rm.log", "w")  # noqa: SIM115 - the server writes to it until killed
    command = [sys.executable, "-m", "raylign.cli.main", "serve-rm", "--reward_file", str(reward_file), "--port", "0"]
    process = subprocess.Popen(
        [*command, *options], env=dict(os.environ, OMP_NUM_THREADS="1", **env), stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    return process


SERVING = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+)/score")


def serving_port(tmp_path: Path, process: subprocess.Popen, timeout_s: float = 60) -> int:
    """The port serve-rm logged, once /health answers on it."""
    log = tmp_path / "serve_rm.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"serve-rm exited early:\n{log.read_text()}"
        found = SERVING.search(log.read_text())
        try:
            if found and httpx.get(f"http://127.0.0.1:{found[1]}/health", timeout=1).status_code == 200:
                return int(found[1])
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    kill_if_running(process)
    raise AssertionError(f"serve-rm did not come up within {timeout_s} s:\n{log.read_text()}")


def kill_if_running(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def start_serve_rm(tmp_path: Path, reward_file: Path, grace_s: float) -> tuple[subprocess.Popen, int]:
    """``raylign serve-rm`` and the port it serves on, once /health answers."""
    process = spawn_serve_rm(tmp_path, reward_file, "--shutdown_grace_s", str(grace_s))
    return process, serving_port(tmp_path, process)


class SlowRequests:
    """Requests sent from threads at once; ``results[i]`` is (status, JSON or text) or the exception's repr."""

    def __init__(self, url: str, bodies: list[dict]):
        self.results: dict[int, object] = {}
        self.sent = threading.Semaphore(0)
        self.threads = [
            threading.Thread(target=self._send, args=(url, i, body), daemon=True) for i, body in enumerate(bodies)
        ]
        for thread in self.threads:
            thread.start()

    def _send(self, url: str, i: int, body: dict) -> None:
        hooks = {"request": [lambda request: self.sent.release()]}
        try:
            with httpx.Client(timeout=httpx.Timeout(30.0), event_hooks=hooks) as http:
                answer = http.post(url, json=body)
            self.results[i] = (answer.status_code, answer.json() if answer.status_code == 200 else answer.text)
        except httpx.HTTPError as err:
            self.results[i] = repr(err)

    def wait_sent(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for _ in self.threads:
            assert self.sent.acquire(timeout=max(0.0, deadline - time.monotonic())), "a request was not sent"

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), f"requests unanswered after {timeout_s} s"


def wait_for_calls(calls_file: Path, count: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = calls_file.read_text().splitlines() if calls_file.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"the reward function was not called {count} time(s) within {timeout_s} s")


def refuses_connections(port: int, timeout_s: float) -> bool:
    """True once a TCP connection to ``port`` is refused (polled until ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        time.sleep(0.02)
    return False


def pid_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def slow_bodies(count: int) -> tuple[list[dict], list[list[float]]]:
    """Requests i = 1..count of two samples, responses of lengths i and 10 + i."""
    bodies = [{"prompts": [f"q{i}", f"r{i}"], "responses": ["a" * i, "b" * (10 + i)]} for i in range(1, count + 1)]
    return bodies, [[float(i), float(10 + i)] for i in range(1, count + 1)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_finishes_the_requests_in_flight_refuses_new_ones_and_exits_0(tmp_path):
    reward_file = write_sleeping_reward_file(tmp_path, sleep_s=0.8)
    process, port = start_serve_rm(tmp_path, reward_file, grace_s=30)
    try:
        bodies, expected = slow_bodies(4)  # scored one after the other: about 3.2 s in all
        requests = SlowRequests(f"http://127.0.0.1:{port}/score", bodies)
        requests.wait_sent(timeout_s=20)
        worker_pid = int(wait_for_calls(tmp_path / "calls.txt", 1, timeout_s=20)[0].split()[0])
        time.sleep(0.5)  # the other three requests reach the server and wait for their turn
        stopped_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert refuses_connections(port, timeout_s=10)
        unanswered_when_refused = len(bodies) - len(requests.results)
        requests.join(timeout_s=30)
        exit_code = process.wait(timeout=30)
        stop_s = time.monotonic() - stopped_at
    finally:
        kill_if_running(process)
    log = (tmp_path / "serve_rm.log").read_text()
    assert unanswered_when_refused >= 1, "the drain ended before new connections were refused"
    assert requests.results == {i: (200, {"rewards": expected[i], "metrics": {}}) for i in range(len(bodies))}, log
    assert exit_code == 0, log
    assert stop_s < 15
    assert pid_gone(worker_pid, timeout_s=5), "the reward worker process outlived the server"
    assert "were cut" not in log


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_requests_past_the_shutdown_grace_are_cut_logged_and_not_scored(tmp_path):
    reward_file = write_sleeping_reward_file(tmp_path, sleep_s=8.0)
    process, port = start_serve_rm(tmp_path, reward_file, grace_s=1)
    try:
        bodies, _ = slow_bodies(2)  # the second waits for the first, which outlasts the grace
        requests = SlowRequests(f"http://127.0.0.1:{port}/score", bodies)
        requests.wait_sent(timeout_s=20)
        wait_for_calls(tmp_path / "calls.txt", 1, timeout_s=20)
        time.sleep(0.3)
        stopped_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        requests.join(timeout_s=20)
        answered_s = time.monotonic() - stopped_at
        exit_code = process.wait(timeout=30)
        stop_s = time.monotonic() - stopped_at
    finally:
        kill_if_running(process)
    log = (tmp_path / "serve_rm.log").read_text()
    assert [r[0] if isinstance(r, tuple) else r for r in requests.results.values()] == [500, 500], log
    assert answered_s < 5.0  # cut after the 1 s grace, not when the 8 s call ends
    assert "2 request(s) still in flight after shutdown_grace_s=1 s were cut" in log
    assert exit_code == 0, log
    assert stop_s < 16  # the grace, then the call in progress ends before the scorer closes
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 1  # the cut request waiting was not scored


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_while_the_scorer_loads_stops_its_workers_and_exits_143(tmp_path):
    """A reward file that takes a minute to import: SIGTERM during that start-up ends serve-rm at
    once, with its worker processes."""
    reward_file = tmp_path / "slow_import.py"
    reward_file.write_text(
        textwrap.dedent(f"""
        import os, time

        with open({str(tmp_path / "importing.txt")!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(60)

        def reward_func(prompts, responses, labels, **metadata):
            return [0.0] * len(responses)
    """)
    )
    process = spawn_serve_rm(tmp_path, reward_file, "--num_workers", "2")
    try:
        worker_pids = [int(line) for line in wait_for_calls(tmp_path / "importing.txt", 2, timeout_s=60)]
        stopped_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        exit_code = process.wait(timeout=30)
        stop_s = time.monotonic() - stopped_at
    finally:
        kill_if_running(process)
    assert exit_code == 143, (tmp_path / "serve_rm.log").read_text()
    assert stop_s < 10
    for pid in worker_pids:
        assert pid_gone(pid, timeout_s=5), "a reward worker process outlived the server"
