"""Progress: a rich bar on a terminal, about 20 plain ``raylign`` log lines a run without one.

pytest's capture replaces stderr with a file that is not a terminal, so these tests see the
non-terminal behaviour unless they say otherwise.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raylign.trainers.progress import Progress

ROOT = Path(__file__).resolve().parents[2]
BAR = "━"
LINE = re.compile(r"^(\w+) (\d+)/(\d+) \((\d+)%\) elapsed (\d+:\d\d:\d\d) eta (\d+:\d\d:\d\d|\?)")


class StepClock:
    """A clock the test moves by hand: each ``tick`` is one second."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += 1.0


@pytest.fixture(autouse=True)
def auto_mode(monkeypatch):
    monkeypatch.delenv("RAYLIGN_PROGRESS", raising=False)


@pytest.fixture
def lines(caplog):
    """The progress lines logged to ``raylign``, in order."""
    caplog.set_level(logging.INFO, logger="raylign")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "raylign" and LINE.match(r.getMessage())]


def run_loop(total: int, stop_at: int | None = None, clock: StepClock | None = None) -> None:
    """Drive Progress as the trainer loop does: position 0 first, then one call per step."""
    clock = clock or StepClock()
    progress = Progress(total, "sft", clock=clock)
    progress.advance_to(0)
    for step in range(1, (stop_at or total) + 1):
        clock.tick()
        progress.advance_to(step, f"loss={step / 100:.2f}")
    progress.close()


def logged_steps(messages: list[str]) -> list[int]:
    return [int(LINE.match(m).group(2)) for m in messages]


def test_without_a_terminal_a_line_every_fifth_of_100_steps_plus_the_first(lines):
    run_loop(100)
    assert logged_steps(lines()) == [1, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95, 100]


def test_line_shows_position_percent_elapsed_eta_and_info(lines):
    run_loop(100)
    # Step 50 at t=50 s with one second per step since position 0: 50 steps left, 50 s to go.
    assert "sft 50/100 (50%) elapsed 0:00:50 eta 0:00:50 | loss=0.50" in lines()


def test_hours_are_shown_as_h_mm_ss(lines):
    clock = StepClock()
    progress = Progress(4, "rl", clock=clock)
    progress.advance_to(0)
    clock.now = 3723.0  # 1 h 2 min 3 s for the first step, so 3 more steps take 3 h 6 min 9 s
    progress.advance_to(1)
    progress.close()
    assert lines() == ["rl 1/4 (25%) elapsed 1:02:03 eta 3:06:09"]


def test_eta_is_unknown_until_a_second_position_is_reported(lines):
    clock = StepClock()
    progress = Progress(1000, "generate", clock=clock)  # generate reports after each batch, never position 0
    clock.tick()
    progress.advance_to(64)
    progress.close()
    assert lines() == ["generate 64/1000 (6%) elapsed 0:00:01 eta ?"]


def test_a_position_that_jumps_past_a_multiple_gets_the_line(lines):
    progress = Progress(100, "score", clock=StepClock())  # batches of 3: 3, 6, ..., 99, then 100
    for done in [*range(3, 100, 3), 100]:
        progress.advance_to(done)
    progress.close()
    # The first position, the first one at or past each multiple of 5, and the last.
    assert logged_steps(lines()) == [3, 6, 12, 15, 21, 27, 30, 36, 42, 45, 51, 57, 60, 66, 72, 75, 81, 87, 90, 96, 100]


def test_short_run_logs_every_step(lines):
    run_loop(4)
    assert logged_steps(lines()) == [1, 2, 3, 4]


def test_close_logs_the_last_position_if_it_has_no_line(lines):
    run_loop(100, stop_at=37)
    assert logged_steps(lines()) == [1, 5, 10, 15, 20, 25, 30, 35, 37]


def test_close_twice_and_advance_after_close_add_nothing(lines):
    progress = Progress(10, "sft", clock=StepClock())
    progress.advance_to(10)
    progress.close()
    progress.close()
    progress.advance_to(10)
    assert logged_steps(lines()) == [10]


def test_no_rich_bar_without_a_terminal(lines, capsys):
    run_loop(100)
    captured = capsys.readouterr()
    assert BAR not in captured.err and BAR not in captured.out
    assert len(lines()) == 21


def test_progress_off_prints_nothing(lines, capsys, monkeypatch):
    monkeypatch.setenv("RAYLIGN_PROGRESS", "off")
    run_loop(100)
    captured = capsys.readouterr()
    assert lines() == []
    assert captured.err == "" and captured.out == ""


def test_disabled_progress_is_silent_even_when_lines_are_forced(lines, capsys, monkeypatch):
    monkeypatch.setenv("RAYLIGN_PROGRESS", "lines")
    progress = Progress(10, "sft", enabled=False)
    for step in range(11):
        progress.advance_to(step)
    progress.close()
    captured = capsys.readouterr()
    assert lines() == [] and captured.err == "" and captured.out == ""


def test_bar_can_be_forced_without_a_terminal(lines, capsys, monkeypatch):
    monkeypatch.setenv("RAYLIGN_PROGRESS", "bar")
    run_loop(10)
    assert BAR in capsys.readouterr().out  # rich prints the final bar to a non-terminal on stop
    assert lines() == []


def test_terminal_on_stderr_gets_the_bar_not_lines(lines, monkeypatch):
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        assert Progress(10, "sft", enabled=False).mode == "off"
        progress = Progress(10, "sft")
        assert progress.mode == "bar"
        progress.close()
    os.close(leader)
    assert lines() == []


def test_unknown_mode_is_rejected(monkeypatch):
    monkeypatch.setenv("RAYLIGN_PROGRESS", "bars")
    with pytest.raises(ValueError, match="RAYLIGN_PROGRESS='bars'"):
        Progress(10, "sft")


@pytest.mark.slow
def test_sft_cli_without_a_terminal_logs_progress_lines(tmp_path, tiny_model_dir):
    script = Path(sys.executable).parent / "raylign"
    command = [str(script)] if script.exists() else [shutil.which("raylign") or "raylign"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAYLIGN_PROGRESS", None)
    proc = subprocess.run(
        command
        + [
            "sft",
            "--config",
            "examples/sft_tiny.yaml",
            "--model.path",
            str(tiny_model_dir),
            "--train.output_dir",
            str(tmp_path / "sft"),
            "--train.max_steps",
            "4",
            "--train.save_every",
            "0",
            "--train.eval_every",
            "0",
            "--train.export",
            "false",
        ],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    # The CLI's log handler may wrap a long line, but each line starts with the position.
    steps = [int(m.group(1)) for m in re.finditer(r"sft (\d+)/4 \(\d+%\) elapsed \d+:\d\d:\d\d eta ", output)]
    assert steps == [1, 2, 3, 4]
    assert BAR not in output
