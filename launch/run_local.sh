#!/usr/bin/env bash
# Single machine: launch/run_local.sh CONFIG [overrides...]  (NPROC_PER_NODE defaults to 2 on CPU; MAX_RESTARTS=N
# restarts the job up to N times after a rank dies, from its newest intact checkpoint: launch/run_node.sh)
# The demo configs (configs/tiny_cpu.yaml, configs/tiny_moe_cpu.yaml) get their model, tokenizer and data made first
# when they are missing (launch/prepare_demo.py), so that they run on a fresh clone without launch/quickstart.sh.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-$( [ -x "$HERE/../.venv/bin/python" ] && echo "$HERE/../.venv/bin/python" || echo python3)}"
if [ $# -ge 1 ] && [ "$1" != "--print-nproc" ]; then
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PYTHON" "$HERE/prepare_demo.py" "$@"
fi
# One vLLM cache (compiled kernels, model inspection) for every local run, as launch/setup_env.sh sets it, rather
# than the engine's default of one per output directory: a fresh run directory then starts the engine seconds faster.
if [ -z "${VLLM_CACHE_ROOT:-}" ] && [ -d "$HERE/../.venv" ]; then
  export VLLM_CACHE_ROOT="$(cd "$HERE/.." && pwd)/.venv/.vllm_cache"
fi
export NNODES=1 NODE_RANK=0 MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" MASTER_PORT="${MASTER_PORT:-29500}"
exec "$HERE/run_node.sh" "$@"
