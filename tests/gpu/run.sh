#!/usr/bin/env bash
# By hand on one NVIDIA GPU (not in CI: pytest does not collect tests/gpu/, whose files are not test_*.py):
#   bash tests/gpu/run.sh [OUT.json]
# Needs torch (CUDA build) and megatron-core 0.16 (e.g. its wheel) in the Python on PATH or $PYTHON; no vLLM and no
# TransformerEngine (the check uses model.transformer_impl=local). Prints one line per phase (tokens/s, peak memory)
# and exits non-zero when a check fails. See tests/gpu/gpu_check.py for what is checked.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${1:-$REPO_ROOT/gpu_check.json}"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.__version__, torch.cuda.get_device_name())"
exec "$PYTHON" -m torch.distributed.run --nproc-per-node=1 --master-port="${MASTER_PORT:-29599}" \
  "$REPO_ROOT/tests/gpu/gpu_check.py" --out "$OUT" "${@:2}"
