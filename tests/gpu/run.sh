#!/usr/bin/env bash
# By hand on one NVIDIA GPU (not in CI: pytest does not collect tests/gpu/, whose files are not test_*.py):
#   bash tests/gpu/run.sh [OUT.json]
# Needs torch (CUDA build), megatron-core 0.16 and fla 0.6 (the gdn_fla phase) in the Python on PATH or $PYTHON
# (installed here from the wheels tests/gpu/fetch_wheels.sh downloads into tests/gpu/wheels/ when one is missing;
# einops, triton and transformers come with the lent machine's image); no vLLM and no TransformerEngine
# (the check uses model.transformer_impl=local and a stand-in rollout engine). Prints one line per phase (tokens/s,
# peak memory) and one PASS/FAIL line per check, and exits non-zero when a check fails. See tests/gpu/gpu_check.py.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${1:-$REPO_ROOT/gpu_check.json}"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# megatron-core and fla (whatever tests/gpu/fetch_wheels.sh put there) from carried wheels, when either is missing.
WHEELS="${GPU_WHEELS:-$REPO_ROOT/tests/gpu/wheels}"
if ! "$PYTHON" -c "import megatron.core, fla.ops.gated_delta_rule" 2>/dev/null \
  && compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-deps "$WHEELS"/*.whl
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.__version__, torch.cuda.get_device_name())"
exec "$PYTHON" -m torch.distributed.run --nproc-per-node=1 --master-port="${MASTER_PORT:-29599}" \
  "$REPO_ROOT/tests/gpu/gpu_check.py" --out "$OUT" "${@:2}"
