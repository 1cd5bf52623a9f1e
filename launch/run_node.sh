#!/usr/bin/env bash
# One invocation per node: launch/run_node.sh CONFIG [dotted.overrides ...]
# Environment: NNODES (1), NODE_RANK (0), NPROC_PER_NODE (default: detected, see below), MASTER_ADDR (127.0.0.1),
# MASTER_PORT (29500), MAX_RESTARTS (0: a job whose rank dies ends; N: torchrun stops and restarts every local rank up
# to N times, and they resume from the newest intact checkpoint, trainer.resume_mode=auto). Source launch/env_cuda.sh
# or launch/env_ascend.sh first on clusters.
# `launch/run_node.sh --print-nproc` prints the processes per node this node would start, and exits.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$( [ -x "$REPO_ROOT/.venv/bin/python" ] && echo "$REPO_ROOT/.venv/bin/python" || echo python3)}"

# Processes per node when NPROC_PER_NODE is not set: one per accelerator.
#   Ascend: A3 (SoC versions 250-255, Atlas A3 / 910_93) 16 devices per node, A2 (220-225, 910B) 8 — the SoC version
#           from torch_npu (vllm-ascend classifies A2/A3 the same way); without torch_npu, npu-smi's device count.
#   CUDA:   `nvidia-smi -L | wc -l`.
#   CPU:    2.
default_nproc() {
  local n
  if n=$("$PYTHON" - 2>/dev/null <<'PY'
import torch_npu  # noqa: F401
v = int(torch_npu.npu.get_soc_version())
print(16 if 250 <= v <= 255 else 8 if 220 <= v <= 225 else torch_npu.npu.device_count())
PY
  ) && [ -n "$n" ] && [ "$n" -gt 0 ]; then echo "$n"; return; fi
  if command -v npu-smi >/dev/null 2>&1; then
    n=$(npu-smi info -l 2>/dev/null | awk -F: '/Total Count/ {gsub(/ /, "", $2); print $2; exit}')
    if [ -n "$n" ] && [ "$n" -gt 0 ]; then echo "$n"; return; fi
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [ -n "$n" ] && [ "$n" -gt 0 ]; then echo "$n"; return; fi
  fi
  echo 2
}

if [ "${1:-}" = "--print-nproc" ]; then echo "${NPROC_PER_NODE:-$(default_nproc)}"; exit 0; fi
if [ $# -lt 1 ]; then echo "usage: $0 CONFIG [overrides...]  |  $0 --print-nproc" >&2; exit 2; fi
CONFIG="$1"; shift
[ -f "$CONFIG" ] || { echo "error: config file $CONFIG not found" >&2; exit 2; }
NPROC="${NPROC_PER_NODE:-$(default_nproc)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The run's rules against this job's world size before any process group or rendezvous: a config that no rank can
# run stops here in seconds with its problem list, once, instead of in every rank (or, for a bad placement, never).
"$PYTHON" -m megatron_dapo.cli preflight "$CONFIG" "$@" --world-size "$(( ${NNODES:-1} * NPROC ))" || exit $?
exec "$PYTHON" -m torch.distributed.run \
  --nnodes="${NNODES:-1}" --node-rank="${NODE_RANK:-0}" --nproc-per-node="$NPROC" \
  --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29500}" \
  --max-restarts="${MAX_RESTARTS:-0}" \
  -m megatron_dapo.cli train "$CONFIG" "$@"
