"""Python-file reward source: worker pool, metrics, metadata, and errors that name the sample and the file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from raylign.rollout.rewards import PythonFileReward, RewardError
from raylign.rollout.rewards.function import metadata_to_columns, split_evenly

REWARD_FILE = """
import os

def reward_func(prompts, responses, labels, **metadata):
    # length of the response, +10 when it equals the label
    rewards = [len(r) + (10.0 if r == l else 0.0) for r, l in zip(responses, labels)]
    return {"rewards": rewards, "bonus": [b if b is not None else -1 for b in metadata["bonus"]],
            "worker_pid": [os.getpid()] * len(prompts), "chunk_size": [len(prompts)] * len(prompts)}

def only_named(prompts, responses, labels, bonus):
    return [float(b) for b in bonus]

def raises(prompts, responses, labels):
    return [1.0 / (len(r) - 3) for r in responses]

def hangs(prompts, responses, labels):
    import time
    if any(r == "hang" for r in responses):
        time.sleep(120)
    return [0.0] * len(prompts)

def too_short(prompts, responses, labels):
    return [1.0] * (len(prompts) - 1)

def not_a_list(prompts, responses, labels):
    return "1.0"

def has_none(prompts, responses, labels):
    return [None] + [1.0] * (len(prompts) - 1)

async def judged(prompts, responses, labels):
    import asyncio
    async def judge(response, label):  # as a call to a judge service would be awaited
        await asyncio.sleep(0.01)
        return float(response == label)
    return list(await asyncio.gather(*(judge(r, l) for r, l in zip(responses, labels))))

NOT_CALLABLE = 3
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    return path


def test_split_evenly_and_metadata_columns():
    assert split_evenly(5, 2) == [(0, 3), (3, 5)]
    assert split_evenly(2, 4) == [(0, 1), (1, 2)]
    assert metadata_to_columns([{"a": 1}, {"a": 2, "b": 3}]) == {"a": [1, 2], "b": [None, 3]}


def test_scores_batch_in_two_workers_with_metrics_and_metadata(reward_file):
    prompts = ["p0", "p1", "p2"]
    responses = ["ab", "xyz", "q"]
    labels = ["ab", "no", "q"]
    metadata = [{"bonus": 5}, {"bonus": 6}, {}]
    with PythonFileReward(reward_file, num_workers=2, timeout_s=30) as source:
        result = source.score(prompts, responses, labels, metadata)
    assert result.rewards == [12.0, 3.0, 11.0]
    assert result.metrics["bonus"] == [5.0, 6.0, -1.0]
    assert result.metrics["chunk_size"] == [2.0, 2.0, 1.0]  # two calls: samples [0, 2) and [2, 3)
    assert os.getpid() not in result.metrics["worker_pid"]  # run in worker processes, not here


def test_function_without_var_keywords_gets_only_the_keys_it_names(reward_file):
    with PythonFileReward(reward_file, function_name="only_named") as source:
        result = source.score(["a", "b"], ["x", "y"], [None, None], [{"bonus": 1, "other": 9}, {"bonus": 2}])
    assert result.rewards == [1.0, 2.0]


def test_an_async_function_is_awaited_in_its_worker(reward_file):
    # It returned a coroutine, which failed to pickle ("cannot pickle 'coroutine' object").
    with PythonFileReward(reward_file, function_name="judged", num_workers=2, timeout_s=30) as source:
        result = source.score(["p0", "p1", "p2"], ["a", "b", "c"], ["a", "x", "c"])
    assert result.rewards == [1.0, 0.0, 1.0]


def test_raising_function_names_first_prompt_of_chunk_its_index_and_cause(reward_file):
    long_prompt = "Please compute the following long expression carefully: " + "1 + " * 50 + "1"
    prompts = ["short one", "short two", long_prompt, "last"]
    responses = ["aaaaa", "bbbbb", "ccc", "ddddd"]  # len 3 divides by zero, in chunk [2, 4)
    with (
        PythonFileReward(reward_file, function_name="raises", num_workers=2) as source,
        pytest.raises(RewardError) as caught,
    ):
        source.score(prompts, responses, [None] * 4)
    message = str(caught.value)
    assert "'raises'" in message and str(reward_file) in message
    assert "2 samples starting at sample 2 (prompt 'Please compute the following long" in message
    assert long_prompt not in message  # truncated
    assert "ZeroDivisionError: float division by zero" in message
    assert "my_rewards.py" in message.split("ZeroDivisionError")[0]  # traceback points into the user's file


def test_hanging_function_hits_the_timeout_then_workers_restart(reward_file):
    with PythonFileReward(reward_file, function_name="hangs", num_workers=1, timeout_s=1.0) as source:
        started = time.monotonic()
        with pytest.raises(
            RewardError,
            match=r"did not return within timeout_s=1.0 s on 2 samples starting at "
            r"sample 0 \(prompt 'first'\)",
        ):
            source.score(["first", "second"], ["ok", "hang"], [None, None])
        assert time.monotonic() - started < 10
        assert source.score(["again"], ["ok"], [None]).rewards == [0.0]


@pytest.mark.parametrize(
    ("function_name", "expected"),
    [
        ("too_short", r"expected 3 values \(one per sample\), got 2"),
        ("not_a_list", r"expected a list of 3 numbers, got str"),
        ("has_none", r"value for sample 0 \(prompt 'a'\) is not a number: None"),
    ],
)
def test_wrong_return_value_names_file_and_function(reward_file, function_name, expected):
    with (
        PythonFileReward(reward_file, function_name=function_name) as source,
        pytest.raises(RewardError, match=expected) as caught,
    ):
        source.score(["a", "b", "c"], ["x", "y", "z"], [None] * 3)
    assert f"'{function_name}' in {reward_file}" in str(caught.value)


def test_missing_function_fails_at_start_listing_what_the_file_has(reward_file):
    with pytest.raises(ValueError, match=r"defines no 'nope' \(callables in it: .*reward_func"):
        PythonFileReward(reward_file, function_name="nope")


def test_uncallable_name_or_missing_file_fails_at_start(reward_file, tmp_path):
    with pytest.raises(ValueError, match=r"'NOT_CALLABLE' in reward file .* is a int, not a function"):
        PythonFileReward(reward_file, function_name="NOT_CALLABLE")
    with pytest.raises(FileNotFoundError, match="absent.py"):
        PythonFileReward(tmp_path / "absent.py")


def test_file_with_import_error_reports_the_traceback(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(ValueError, match=r"importing reward file .*broken.py failed:(.|\n)*not_a_real_module_xyz"):
        PythonFileReward(broken)


KILLER_FILE = """
import os, signal
from pathlib import Path

def dies_once(prompts, responses, labels):
    # the first call kills its own worker process (as the OOM killer would); later calls score
    marker = Path(__file__).with_suffix(".died")
    if not marker.exists():
        marker.write_text("x")
        os.kill(os.getpid(), signal.SIGKILL)
    return [float(len(r)) for r in responses]

def always_dies(prompts, responses, labels):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_killed_mid_batch_is_restarted_and_the_batch_scored_again(tmp_path):
    path = tmp_path / "killer.py"
    path.write_text(textwrap.dedent(KILLER_FILE))
    with PythonFileReward(path, function_name="dies_once", num_workers=2, timeout_s=60) as source:
        result = source.score(["p1", "p2", "p3"], ["a", "bbb", "cc"], None)
        assert result.rewards == [1.0, 3.0, 2.0]
        assert source.restarts == 1
        assert source.score(["p4"], ["dddd"], None).rewards == [4.0]  # the new workers keep serving
        assert source.restarts == 1


def test_a_worker_killed_between_batches_is_restarted_on_the_next_one(reward_file):
    """The pool is already broken when the next batch is handed in (the OOM killer struck while it
    idled): handing in fails, not waiting, and the batch is scored by fresh workers all the same."""
    import signal

    with PythonFileReward(reward_file, num_workers=1, timeout_s=60) as source:
        (pid,) = set(source.score(["a"], ["xy"], ["xy"], [{"bonus": 1}]).metrics["worker_pid"])
        os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not source._executor._broken and time.monotonic() < deadline:  # the pool notices the death
            time.sleep(0.05)
        assert source._executor._broken, "the process pool did not notice its worker's death within 30 s"
        result = source.score(["b"], ["xyz"], ["no"], [{"bonus": 2}])
        assert result.rewards == [3.0] and result.metrics["worker_pid"] != [pid]
        assert source.restarts == 1


def test_a_batch_that_kills_its_worker_after_a_restart_too_is_an_error(tmp_path):
    path = tmp_path / "killer.py"
    path.write_text(textwrap.dedent(KILLER_FILE))
    with PythonFileReward(path, function_name="always_dies", num_workers=1, timeout_s=60) as source:
        with pytest.raises(
            RewardError,
            match=r"'always_dies' .*: a worker process died \(killed, out of memory or "
            r"os._exit\) on 2 samples starting at sample 0 \(prompt 'p1'\), "
            r"again after a restart",
        ):
            source.score(["p1", "p2"], ["a", "b"], None)
        assert source.restarts == 1


def test_workers_ignore_an_interrupt_sent_to_the_whole_process_group(reward_file):
    """Ctrl+C reaches every process of the terminal's group: the workers leave the decision to stop
    to the process that owns them, and keep scoring."""
    import signal

    with PythonFileReward(reward_file, num_workers=1, timeout_s=60) as source:
        (pid,) = set(source.score(["a"], ["xy"], ["xy"], [{"bonus": 1}]).metrics["worker_pid"])
        os.kill(int(pid), signal.SIGINT)
        time.sleep(0.5)
        result = source.score(["b"], ["xyz"], ["no"], [{"bonus": 2}])
        assert result.rewards == [3.0] and result.metrics["worker_pid"] == [pid]
        assert source.restarts == 0


def test_a_script_without_a_main_guard_is_told_to_add_one(reward_file, tmp_path):
    """Spawned workers import the main script again; one that builds the source at import time
    kills them at start, and the error says how to fix the script."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from raylign.rollout.rewards import PythonFileReward\n"
        f"PythonFileReward({str(reward_file)!r}, num_workers=1, timeout_s=60).close()\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1
    assert 'create it under `if __name__ == "__main__":`' in proc.stderr.splitlines()[-1]
