"""The code sandbox runs untrusted Python in a real, confined process: each test runs one."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from pathlib import Path

import pytest

from raylign.agents.sandbox import (
    SandboxLimits,
    run_python,
    run_python_async,
    sandbox_backend,
)

from .sandbox_helpers import sandbox_processes, scratch_dirs

pytestmark = pytest.mark.slow  # about 12 s of sandboxed runs

SMALL = SandboxLimits(cpu_time_s=1, wall_time_s=3, memory_mb=256)
ROOMY = SandboxLimits(cpu_time_s=1, wall_time_s=10, memory_mb=256)  # room for a 3 s sleep
BACKEND = sandbox_backend()
hides_filesystem = pytest.mark.skipif(BACKEND != "bwrap", reason=f"backend {BACKEND!r} does not hide the filesystem")
cuts_network = pytest.mark.skipif(BACKEND == "rlimit", reason="the 'rlimit' backend has no network namespace")


def test_print_returns_its_output():
    result = run_python("print(6*7)", SMALL)
    assert (result.ok, result.stdout, result.failure, result.exit_code) == (True, "42\n", None, 0)


def test_an_exception_is_an_error_with_the_exception_in_the_message():
    result = run_python("1/0", SMALL)
    assert (result.ok, result.failure, result.exit_code) == (False, "error", 1)
    assert "ZeroDivisionError: division by zero" in result.message
    assert "ZeroDivisionError" in result.stderr


def test_an_exception_whose_message_says_timeout_is_an_error_not_a_network_failure():
    result = run_python("settings = {}\nsettings['timeout']", SMALL)
    assert (result.ok, result.failure, result.exit_code) == (False, "error", 1)
    assert result.message == "failed with exit code 1: KeyError: 'timeout'"


def test_a_socket_timeout_is_a_network_failure():
    result = run_python("import socket\nraise socket.timeout('timed out')", SMALL)
    assert (result.ok, result.failure) == (False, "network")


def test_the_exit_status_is_reported():
    result = run_python("raise SystemExit(3)", SMALL)
    assert (result.ok, result.failure, result.exit_code) == (False, "error", 3)


def test_an_infinite_loop_is_stopped_near_the_cpu_limit():
    result = run_python("while True: pass", SMALL)
    assert not result.ok
    assert result.failure in ("cpu_time", "timeout")
    # Stopped by whichever limit came first: 1 s of CPU takes at least 1 s, the wall limit is 3 s.
    assert 0.9 * min(SMALL.cpu_time_s, SMALL.wall_time_s) <= result.seconds < SMALL.wall_time_s + 2


def test_sleeping_past_the_wall_time_is_a_timeout():
    result = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_time_s=1))
    assert (result.ok, result.failure, result.exit_code) == (False, "timeout", None)
    assert 0.9 <= result.seconds < 3  # stopped at its 1 s wall time, not before
    assert sandbox_processes() == []


def test_allocating_past_the_memory_limit_fails_with_memory():
    result = run_python("b = bytearray(2 << 30)", SMALL)
    assert (result.ok, result.failure) == (False, "memory")


def test_a_fork_bomb_is_stopped_and_leaves_nothing_running():
    result = run_python("import os\nwhile True:\n    os.fork()", SMALL)
    assert (result.ok, result.failure) == (False, "processes")
    assert sandbox_processes() == []


@hides_filesystem
def test_writing_outside_the_scratch_directory_fails(tmp_path: Path):
    target = tmp_path / "escaped.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", SMALL)
    assert (result.ok, result.failure) == (False, "filesystem")
    assert not target.exists()


@hides_filesystem
def test_writing_to_the_home_directory_fails():
    target = Path.home() / f"raylign-sandbox-escape-{uuid.uuid4().hex}.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", SMALL)
    assert (result.ok, result.failure) == (False, "filesystem")
    assert not target.exists()


@hides_filesystem
def test_a_file_in_another_temporary_directory_is_not_readable(tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2-do-not-leak")
    result = run_python(f"print(open({str(secret)!r}).read())", SMALL)
    assert (result.ok, result.failure) == (False, "filesystem")
    assert "hunter2-do-not-leak" not in result.stdout


@hides_filesystem
def test_the_code_has_no_capabilities_and_cannot_make_the_host_usr_writable():
    # Started by root, bwrap keeps every capability in the sandbox's user namespace unless told to
    # drop them; with CAP_SYS_ADMIN the code can remount the read-only bind of /usr read-write.
    code = (
        "import ctypes, os\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        "ctypes.CDLL(None).mount(None, b'/usr', None, 32 | 4096, None)  # MS_REMOUNT | MS_BIND, not MS_RDONLY\n"
        "print(bool(os.statvfs('/usr').f_flag & os.ST_RDONLY))\n"
    )
    result = run_python(code, SMALL)
    assert (result.ok, result.stdout) == (True, "0000000000000000\nTrue\n")


@cuts_network
def test_a_listening_socket_on_the_host_loopback_is_unreachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", SMALL)
    assert (result.ok, result.failure) == (False, "network")


@cuts_network
def test_an_external_address_is_unreachable():
    result = run_python("import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=1)", SMALL)
    assert (result.ok, result.failure) == (False, "network")


def test_the_scratch_directory_is_writable_and_removed_afterwards(scratch_parent):
    code = "open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())"
    result = run_python(code, SMALL)
    assert (result.ok, result.stdout) == (True, "kept\n")
    assert scratch_dirs(scratch_parent) == set()


def test_output_past_the_limit_is_truncated_with_a_marker():
    result = run_python("print('x' * 10000)", SandboxLimits(max_output_chars=100))
    assert result.ok
    first, marker = result.stdout.split("\n", 1)
    assert first == "x" * 100
    assert marker == "[output truncated: first 100 characters of 10001 bytes shown]"


@pytest.mark.parametrize("field", ["cpu_time_s", "wall_time_s", "memory_mb", "max_processes", "max_file_mb"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_limits_are_rejected_naming_the_field(field: str, value: int):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field} must be a positive number"):
        SandboxLimits(**{field: value})


def test_async_calls_run_concurrently_without_blocking_the_loop():
    async def main() -> tuple[list, float, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        started = time.monotonic()
        code = "import time\ntime.sleep(3)\nprint({})"
        results = await asyncio.gather(*(run_python_async(code.format(i), ROOMY) for i in range(2)))
        elapsed = time.monotonic() - started
        ticker.cancel()
        return results, elapsed, ticks

    results, elapsed, ticks = asyncio.run(main())
    assert [(r.ok, r.stdout) for r in results] == [(True, "0\n"), (True, "1\n")]
    assert elapsed < 5  # one after the other, the two sleeps alone would take 6 s
    assert ticks >= 30  # the loop kept running: about 60 ticks of 50 ms in 3 s


def test_the_blocking_call_also_works_inside_a_running_event_loop():
    async def main():
        return run_python("print('inside')", SMALL)

    result = asyncio.run(main())
    assert (result.ok, result.stdout) == (True, "inside\n")


def test_the_rlimit_fallback_warns_once_and_still_stops_a_loop(monkeypatch, caplog):
    monkeypatch.setenv("RAYLIGN_SANDBOX_BACKEND", "rlimit")
    with caplog.at_level(logging.WARNING, logger="raylign.agents.sandbox"):
        assert sandbox_backend() == "rlimit"
        first = run_python("print(6*7)", SMALL)
        looping = run_python("while True: pass", SMALL)
    assert (first.ok, first.stdout) == (True, "42\n")
    assert (looping.ok, looping.failure) == (False, "cpu_time")
    warnings = [r.getMessage() for r in caplog.records if "'rlimit'" in r.getMessage()]
    assert len(warnings) == 1
    assert "NOT isolated: the filesystem, the network" in warnings[0]


def test_run_python_called_inside_a_running_event_loop_runs_on_a_loop_of_its_own():
    async def a_tool_called_from_async_code():
        return run_python("print(6 * 7)")

    result = asyncio.run(a_tool_called_from_async_code())
    assert (result.ok, result.stdout, result.exit_code) == (True, "42\n", 0)
