"""The suite runs its test files longest first, by the seconds measured in tests/durations.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.file_order import DURATIONS, DurationRecorder, load_durations, order_by_duration

REPO = Path(__file__).resolve().parents[1]


def test_files_go_longest_first_unknown_ones_as_the_median_and_each_keeps_its_test_order():
    durations = {"a.py": 10.0, "b.py": 300.0, "c.py": 40.0, "d.py": 40.0}  # median 40
    collected = ["a.py::t1", "c.py::t1", "new.py::t1", "a.py::t2", "b.py::t1", "d.py::t1", "new.py::t2", "c.py::t2"]
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in collected]
    order_by_duration(items, durations)
    # b (300); then c, new and d at 40 in the order their files first appeared; then a (10).
    expected = ["b.py::t1", "c.py::t1", "c.py::t2", "new.py::t1", "new.py::t2", "d.py::t1", "a.py::t1", "a.py::t2"]
    assert [item.nodeid for item in items] == expected
    unchanged = [SimpleNamespace(nodeid=nodeid) for nodeid in collected]
    order_by_duration(unchanged, {})
    assert [item.nodeid for item in unchanged] == collected


def test_the_recorder_adds_up_each_files_setup_call_and_teardown(tmp_path):
    recorder = DurationRecorder(tmp_path / "durations.json", "some cpu")
    for nodeid, when, seconds in [
        ("tests/x.py::a", "setup", 2.5),
        ("tests/x.py::a", "call", 1.25),
        ("tests/x.py::b[1]", "call", 0.5),
        ("tests/x.py::a", "teardown", 0.25),
        ("tests/y.py::c", "call", 3.0),
    ]:
        recorder.pytest_runtest_logreport(
            pytest.TestReport(nodeid, ("tests/x.py", 0, "a"), {}, "passed", None, when, duration=seconds)
        )
    recorder.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace()))
    written = json.loads((tmp_path / "durations.json").read_text())
    assert written == {"machine": "some cpu", "files": {"tests/x.py": 4.5, "tests/y.py": 3.0}}
    assert load_durations(tmp_path / "durations.json") == {"tests/x.py": 4.5, "tests/y.py": 3.0}


def test_a_malformed_durations_file_is_named_with_how_to_rewrite_it(tmp_path):
    bad = tmp_path / "durations.json"
    bad.write_text('{"tests/x.py": 3}')
    with pytest.raises(pytest.UsageError, match=r"durations.json: expected .*--write-durations"):
        load_durations(bad)


def test_the_committed_durations_order_what_pytest_collects(tmp_path):
    durations = load_durations(DURATIONS)
    assert len(durations) > 50 and all(seconds >= 0 for seconds in durations.values())
    listed = [name for name in durations if (REPO / name).exists()]  # a renamed file counts as a new one
    # Three files named shortest first on the command line are collected longest first.
    chosen = sorted(listed, key=durations.get)
    chosen = [chosen[0], chosen[len(chosen) // 2], chosen[-1]]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", *chosen],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = []
    for line in done.stdout.splitlines():
        if "::" in line and line.split("::", 1)[0] not in files:
            files.append(line.split("::", 1)[0])
    assert files == chosen[::-1]
