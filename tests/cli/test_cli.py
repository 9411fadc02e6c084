"""The console entry point: --help, --print-config and errors before any work starts."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
import yaml

from raylign.cli.main import help_option, main
from raylign.config.base import describe_fields
from raylign.config.commands import SFTConfig


def test_help_lists_every_field_with_default_and_description(capsys):
    assert main(["sft", "--help"]) == 0
    text = capsys.readouterr().out
    for dotted, type_text, _default, description in describe_fields(SFTConfig):
        if type_text == "section":
            continue
        assert f"  {help_option(dotted)}  (" in text, dotted
        assert description, f"{dotted} has no description"
        assert description in text
    assert "--optim.lr  (float, default 1e-05)" in text


def test_print_config_shows_resolved_values(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"train": [{"path": "t.jsonl"}]}}))
    assert main(["sft", "--config", str(path), "--print-config", "--optim.lr", "0.5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optim"]["lr"] == 0.5
    assert printed["model"]["path"] == "m"
    assert printed["train"]["global_batch_size"] == 32


def test_bad_config_exits_2_naming_field(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "m", "dtyp": "bfloat16"}, "data": {"train": []}}))
    assert main(["sft", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.dtyp: unknown field" in err


def test_unknown_command_exits_2(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "raylign.cli.main", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "sft" in out.stdout and "quickstart" in out.stdout


def test_a_run_stopped_by_a_known_fault_ends_in_one_line_and_exit_1(tmp_path):
    """Faults the user can fix (here an output folder that cannot be written) end the command with
    their message on one line, not a traceback; RAYLIGN_DEBUG=1 brings the traceback back."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    args = ["-m", "raylign.cli.main", "sft", "--model.path", "m", "--data.train", "[x.jsonl]"]
    args += ["--train.output_dir", str(blocker / "run")]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"train.output_dir {blocker}/run cannot be written (Not a directory)" in proc.stderr.splitlines()[-1]


def test_a_model_folder_the_user_may_not_read_ends_in_one_line_naming_the_file(tied_model_dir, tmp_path):
    from tests.unreadable import run_unable_to_read

    model = tmp_path / "model"
    shutil.copytree(tied_model_dir, model)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "a{i}", "completion": "b{i}"}}\n' for i in range(32)))
    args = ["-m", "raylign.cli.main", "sft", "--model.path", str(model), "--data.train", f"[{data}]"]
    proc = run_unable_to_read(model, [*args, "--train.output_dir", str(tmp_path / "run")], cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"Permission denied: '{model}/" in proc.stderr.splitlines()[-1]


def test_a_setting_whose_package_is_missing_ends_in_one_line_naming_the_install(tied_model_dir, tmp_path):
    """logging.wandb without wandb installed: the install command on one line, exit 1. Only a missing
    optional package is reported that way; any other ImportError is a bug and keeps its traceback."""
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "a{i}", "completion": "b{i}"}}\n' for i in range(32)))
    args = ["-m", "raylign.cli.main", "sft", "--model.path", str(tied_model_dir), "--data.train", f"[{data}]"]
    args += ["--train.output_dir", str(tmp_path / "run"), "--train.logging.wandb", "true"]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "wandb is not installed: pip install 'raylign[wandb]'" in proc.stderr.splitlines()[-1]


def test_rl_help_lists_the_fields_of_its_optional_sections_and_says_presets_change_defaults(capsys):
    assert main(["rl", "--help"]) == 0
    text = capsys.readouterr().out
    # A list item's field is not an option of its own (--reward.sources[].kind is an unknown field): the help
    # names it without dashes and says how the list is given on the command line.
    assert "[reward] " in text and "\n  reward.sources[].kind  (" in text and "--reward.sources[]" not in text
    assert "the whole list: --reward.sources '[{field: value, ...}, ...]'" in text
    assert "[reference] " in text and "--reference.path  (" in text
    assert "A preset sets some of these defaults its own way" in text
