#!/usr/bin/env bash
# One invocation per node: launch/run_node.sh CONFIG [dotted.overrides ...]
# Environment: NNODES (1), NODE_RANK (0), NPROC_PER_NODE (accelerators per node, or 2 on CPU), MASTER_ADDR (127.0.0.1),
# MASTER_PORT (29500). Source launch/env_cuda.sh or launch/env_ascend.sh first on clusters.
set -euo pipefail
if [ $# -lt 1 ]; then echo "usage: $0 CONFIG [overrides...]" >&2; exit 2; fi
CONFIG="$1"; shift
[ -f "$CONFIG" ] || { echo "error: config file $CONFIG not found" >&2; exit 2; }
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$( [ -x "$REPO_ROOT/.venv/bin/python" ] && echo "$REPO_ROOT/.venv/bin/python" || echo python3)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" -m torch.distributed.run \
  --nnodes="${NNODES:-1}" --node-rank="${NODE_RANK:-0}" --nproc-per-node="${NPROC_PER_NODE:-2}" \
  --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29500}" \
  -m megatron_dapo.cli train "$CONFIG" "$@"
