"""serve-rm requests/s and p50/p99 latency under 1-64 concurrent clients, beside the scorer called in-process.

Two scorers, each served by its own server process on 127.0.0.1:

* ``exact``: the built-in exact-match reward in serve-rm's uvicorn server
  (``raylign.cli.serve_rm.uvicorn_server``), scored in the server process;
* ``file``: ``raylign serve-rm --reward_file`` with the same rule in a Python file, so each call
  also crosses into the reward worker process.

At each concurrency level, that many client coroutines (one ``httpx.AsyncClient`` and connection
each) send ``--requests`` requests of ``--samples`` samples in all, after a warm-up round.
Every answer is checked against the rewards its own request must get (the samples of request i
match their labels where the binary digits of i are 1); a wrong answer or a failed request counts
as an error. The floor beside it is the same scorer's ``score()`` called in this process, one
request after another, without HTTP. The clients run on the same cores as the server: on a
small machine their CPU time is part of what is measured, so the table also gives the server
process's own CPU time per request (the reward worker process of ``file`` not included). A run
takes about a minute.

    python benchmarks/serve_rm_load.py
    python benchmarks/serve_rm_load.py --scorers exact --levels 1,16 --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

REWARD_FILE = """
def reward_func(prompts, responses, labels, **metadata):
    return [1.0 if " ".join(r.split()) == " ".join(str(l).split()) else 0.0 for r, l in zip(responses, labels)]
"""


def make_request(index: int, samples: int) -> tuple[dict, list[float]]:
    """Request ``index`` and its rewards: sample k matches its label (1.0) where digit k of index is 1."""
    digits = [(index >> k) & 1 for k in range(samples)]
    labels = [f"answer {index}-{k}" for k in range(samples)]
    responses = [f" {label} " if digit else f"{label}?" for label, digit in zip(labels, digits)]
    prompts = [f"request {index} sample {k}" for k in range(samples)]
    return {"prompts": prompts, "responses": responses, "labels": labels}, [float(d) for d in digits]


def percentiles_ms(latencies: list[float]) -> tuple[float, float]:
    ms = sorted(1000 * t for t in latencies)
    return statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; its children not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_exact_match(port: int) -> None:
    """The child process of the ``exact`` scorer: serve-rm's server and signal handling, built-in reward."""
    from raylign.cli.serve_rm import stop_signals_end_serving, uvicorn_server
    from raylign.rollout.rewards import ExactMatchReward
    from raylign.rollout.rewards.server import create_app

    server = uvicorn_server(create_app(ExactMatchReward()), "127.0.0.1", port, shutdown_grace_s=5)
    with stop_signals_end_serving(server):
        server.run()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(scorer: str, reward_file: Path, port: int) -> subprocess.Popen:
    if scorer == "exact":
        command = [sys.executable, __file__, "--serve-exact-match", str(port)]
    else:
        command = [
            sys.executable,
            "-m",
            "raylign.cli.main",
            "serve-rm",
            "--reward_file",
            str(reward_file),
            "--port",
            str(port),
        ]
    process = subprocess.Popen(command, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    stop_server(process)
    raise RuntimeError(f"the {scorer} server did not come up")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


async def http_level(url: str, clients: int, requests: list[tuple[dict, list[float]]]) -> dict:
    """``clients`` coroutines share out ``requests``; requests/s over the run, latency per request, errors."""
    latencies: list[float] = []
    errors = 0
    pending = iter(requests)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal errors
        for body, expected in pending:  # one shared iterator: each request is sent once
            started = time.perf_counter()
            try:
                answer = await http.post(url, json=body)
                correct = answer.status_code == 200 and answer.json()["rewards"] == expected
            except (httpx.HTTPError, ValueError, KeyError):
                correct = False
            latencies.append(time.perf_counter() - started)
            errors += not correct

    # One client (one connection) per coroutine: a pool shared by many connections costs the
    # client more CPU per request than the server spends on it.
    https = [httpx.AsyncClient(timeout=httpx.Timeout(30.0)) for _ in range(clients)]
    try:
        await asyncio.gather(*(http.post(url, json=requests[0][0]) for http in https))  # warm-up: connect
        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client(http) for http in https)), timeout=600)
        wall_s = time.perf_counter() - started
    finally:
        await asyncio.gather(*(http.aclose() for http in https))
    p50, p99 = percentiles_ms(latencies)
    return {
        "clients": clients,
        "requests_per_s": len(requests) / wall_s,
        "p50_ms": p50,
        "p99_ms": p99,
        "errors": errors,
    }


def in_process_floor(scorer, requests: list[tuple[dict, list[float]]]) -> dict:
    """The scorer's ``score()`` called here, one request after another: what the server adds HTTP to."""
    latencies, errors = [], 0
    scorer.score(**requests[0][0])  # warm-up
    started = time.perf_counter()
    for body, expected in requests:
        call_started = time.perf_counter()
        errors += scorer.score(**body).rewards != expected
        latencies.append(time.perf_counter() - call_started)
    wall_s = time.perf_counter() - started
    p50, p99 = percentiles_ms(latencies)
    return {
        "clients": "-",
        "requests_per_s": len(requests) / wall_s,
        "p50_ms": p50,
        "p99_ms": p99,
        "errors": errors,
        "server_cpu_ms": None,
    }


def make_scorer(name: str, reward_file: Path):
    from raylign.rollout.rewards import ExactMatchReward
    from raylign.rollout.rewards.function import PythonFileReward

    return ExactMatchReward() if name == "exact" else PythonFileReward(reward_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scorers", default="exact,file", help="comma-separated: exact, file")
    parser.add_argument("--levels", default="1,4,16,64", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--requests", type=int, default=600, help="requests per level (and for the floor)")
    parser.add_argument("--samples", type=int, default=10, help="samples per request")
    parser.add_argument("--serve-exact-match", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_exact_match is not None:
        serve_exact_match(args.serve_exact_match)
        return
    from raylign.hardware import cpu_flags, cpu_model

    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in cpu_flags()]
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, {isa}; load average before the run {os.getloadavg()[0]:.2f}"
    )
    requests = [make_request(i, args.samples) for i in range(1, args.requests + 1)]
    reward_file = Path(tempfile.mkdtemp(prefix="raylign-serve-rm-bench-")) / "exact_match.py"
    reward_file.write_text(REWARD_FILE)
    rows = []
    for name in args.scorers.split(","):
        scorer = make_scorer(name, reward_file)
        try:
            rows.append((name, "in-process", in_process_floor(scorer, requests)))
        finally:
            scorer.close()
        port = free_port()
        process = start_server(name, reward_file, port)
        try:
            for clients in (int(level) for level in args.levels.split(",")):
                cpu_before = process_cpu_s(process.pid)
                result = asyncio.run(http_level(f"http://127.0.0.1:{port}/score", clients, requests))
                # the warm-up round's requests are in it too
                result["server_cpu_ms"] = 1000 * (process_cpu_s(process.pid) - cpu_before) / (len(requests) + clients)
                rows.append((name, "HTTP", result))
                print(f"  done: {name} HTTP, {clients} clients, {result['requests_per_s']:.0f} requests/s", flush=True)
        finally:
            stop_server(process)
    print(
        f"\nserve-rm load: {args.requests} requests of {args.samples} samples per row, load average after "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'scorer':7s} {'path':11s} {'clients':>7s} {'requests/s':>10s} {'p50 ms':>8s} {'p99 ms':>8s} "
        f"{'errors':>6s} {'server CPU ms/request':>21s}"
    )
    for name, path, r in rows:
        cpu = "-" if r["server_cpu_ms"] is None else f"{r['server_cpu_ms']:.2f}"
        print(
            f"{name:7s} {path:11s} {r['clients']!s:>7s} {r['requests_per_s']:10.0f} {r['p50_ms']:8.3f} "
            f"{r['p99_ms']:8.3f} {r['errors']:6d} {cpu:>21s}"
        )


if __name__ == "__main__":
    main()
