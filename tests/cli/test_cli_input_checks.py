"""Bad command-line input ends in one clear line, and a closed stdout ends a command quietly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from raylign.cli import doctor
from raylign.cli import main as cli_main
from raylign.cli.main import main


def run_raylign(*args: str, cwd: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "raylign.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_a_model_path_that_is_a_file_ends_in_one_line_and_exit_1(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{}")
    proc = run_raylign("estimate-memory", "--model", str(config), cwd=tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"model path '{config}' is a file, not a folder" in proc.stderr.splitlines()[-1]


def test_a_tokenizer_path_that_is_a_file_ends_in_one_line_and_exit_1(tmp_path):
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("data: {train: [rows.jsonl]}\n")
    proc = run_raylign("sft", "--config", str(run_yaml), "--model.path", str(run_yaml), cwd=tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"tokenizer path '{run_yaml}' is a file, not a folder" in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("args", [["--help"], ["rl", "--help"]], ids=["usage", "command-help"])
def test_help_into_a_pipe_nobody_reads_ends_quietly(args):
    """``raylign --help | head -1``: the reader quits before the help is written (here it never
    reads), and the command stops without a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        command = [sys.executable, "-m", "raylign.cli.main", *args]
        proc = subprocess.run(command, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (1, "")


def test_a_broken_pipe_other_than_stdout_keeps_its_traceback(monkeypatch, capfd):
    def run_with_a_broken_connection(argv):
        raise BrokenPipeError("the reward server went away")

    monkeypatch.setattr(cli_main, "_run", run_with_a_broken_connection)
    with pytest.raises(BrokenPipeError, match="the reward server went away"):
        main(["score"])


@pytest.mark.parametrize("option", ["--import-timeout", "--ray-timeout"])
def test_doctor_refuses_a_timeout_of_0_naming_the_option(option, capsys):
    with pytest.raises(SystemExit) as stopped:
        doctor.main(["--skip-ray", option, "0"])
    assert stopped.value.code == 2
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert last_line == f"raylign doctor: error: argument {option}: expected a number of seconds above 0, got '0'"


def test_select_refuses_both_outputs_in_one_file(tmp_path, capsys):
    args = [
        "--input_path",
        "scored.jsonl",
        "--best_of_n.output_path",
        "same.jsonl",
        "--pairs.output_path",
        "same.jsonl",
    ]
    assert main(["select", *args, "--print-config"]) == 2
    assert (
        "best_of_n.output_path and pairs.output_path are the same file (same.jsonl); give each of them its own path"
        in capsys.readouterr().err
    )


def test_select_refuses_an_output_in_its_input_file_however_it_is_spelled(capsys):
    args = ["--input_path", "scored.jsonl", "--pairs.output_path", "./scored.jsonl"]
    assert main(["select", *args, "--print-config"]) == 2
    assert (
        "input_path and pairs.output_path are the same file (./scored.jsonl); give each of them its own path"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("args", "fields"),
    [
        (["--metrics_path", "out.jsonl", "--output_path", "out.jsonl"], "output_path and metrics_path"),
        (["--metrics_path", "./gen.jsonl"], "input_path and metrics_path"),
        (["--output_path", "gen.jsonl"], "input_path and output_path"),
        # The summary's default file, next to the output.
        (["--input_path", "out.metrics.json", "--output_path", "out.jsonl"], "input_path and metrics_path"),
    ],
)
def test_score_refuses_a_summary_or_output_that_would_replace_another_of_its_files(args, fields, capsys):
    # The summary used to replace the scored rows (or the generations) without a word.
    reward = ["--reward.sources", "[{kind: exact_match}]"]
    assert main(["score", "--input_path", "gen.jsonl", *reward, *args, "--print-config"]) == 2
    error = capsys.readouterr().err
    assert f"{fields} are the same file" in error
    assert "give each of them its own path (a later write would replace the scored rows or the generations)" in error


def test_generate_refuses_an_output_in_one_of_its_prompt_files(capsys):
    args = ["--model.path", "m", "--data.prompts", "[a.jsonl, b.jsonl]", "--output_path", "./b.jsonl"]
    assert main(["generate", *args, "--print-config"]) == 2
    assert (
        "data.prompts.1.path and output_path are the same file (./b.jsonl); give each of them its own path "
        "(the generations would replace the prompts)" in capsys.readouterr().err
    )


def test_tiny_model_into_an_existing_file_ends_in_one_line_and_exit_1(tmp_path):
    existing = tmp_path / "afile.yaml"
    existing.write_text("kept: true\n")
    proc = run_raylign("tiny-model", "--output_dir", str(existing), cwd=tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"output folder '{existing}' is a file, not a folder" in proc.stderr.splitlines()[-1]
    assert existing.read_text() == "kept: true\n"


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--num_heads", "3"], "hidden_size (64) must be a multiple of twice num_heads (3)"),
        (["--hidden_size", "100"], "hidden_size (100) must be a multiple of twice num_heads (4)"),
    ],
    ids=["heads-do-not-divide-the-width", "odd-head-size"],
)
def test_tiny_model_refuses_a_width_that_does_not_split_into_even_heads(args, problem, tmp_path, capsys):
    assert main(["tiny-model", "--output_dir", str(tmp_path), *args, "--print-config"]) == 2
    assert problem in capsys.readouterr().err


def test_tiny_model_refuses_kv_heads_that_do_not_divide_the_heads(tmp_path, capsys):
    assert main(["tiny-model", "--output_dir", str(tmp_path), "--num_kv_heads", "3", "--print-config"]) == 2
    assert "num_heads (4) must be a multiple of num_kv_heads (3)" in capsys.readouterr().err


def test_tiny_model_takes_a_shape_with_even_heads_in_whole_groups(tmp_path, capsys):
    args = ["--hidden_size", "128", "--num_heads", "2", "--num_kv_heads", "1", "--print-config"]
    assert main(["tiny-model", "--output_dir", str(tmp_path), *args]) == 0


def test_quickstart_refuses_a_width_with_an_odd_head_size(tmp_path, capsys):
    assert main(["quickstart", "--output_dir", str(tmp_path), "--hidden_size", "100", "--print-config"]) == 2
    assert "hidden_size (100) must be a multiple of twice num_heads (4)" in capsys.readouterr().err


def test_several_processes_on_the_local_backend_are_refused_before_any_start():
    from raylign.config.base import ConfigError, parse_config
    from raylign.config.engine import EngineConfig

    with pytest.raises(ConfigError, match="engine.num_processes 2 needs engine.backend 'fsdp2' or 'deepspeed'"):
        parse_config(EngineConfig, {"backend": "local", "num_processes": 2})
    assert parse_config(EngineConfig, {"backend": "fsdp2", "num_processes": 2}).num_processes == 2


def test_a_second_config_file_is_refused_not_dropped(tmp_path, capsys):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("model: {path: /m}\ndata: {train: [t.jsonl]}\noptim: {lr: 0.5}\n")
    second.write_text("model: {path: /m}\ndata: {train: [t.jsonl]}\n")
    # The last file won: lr 0.5 of the first was gone with nothing said.
    assert main(["sft", "--config", str(first), f"--config={second}", "--print-config"]) == 2
    assert f"--config is given 2 times ({first}, {second}); give one file" in capsys.readouterr().err


def test_a_config_file_the_user_may_not_read_ends_in_one_line_and_exit_2(tmp_path):
    from tests.unreadable import run_unable_to_read

    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("data: {train: [rows.jsonl]}\n")
    proc = run_unable_to_read(run_yaml, ["-m", "raylign.cli.main", "sft", "--config", str(run_yaml)], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"raylign sft: config file {run_yaml} cannot be read: Permission denied"
