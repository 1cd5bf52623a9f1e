#!/usr/bin/env bash
# Single machine: launch/run_local.sh CONFIG [overrides...]  (NPROC_PER_NODE defaults to 2 on CPU)
set -euo pipefail
export NNODES=1 NODE_RANK=0 MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" MASTER_PORT="${MASTER_PORT:-29500}"
exec "$(dirname "${BASH_SOURCE[0]}")/run_node.sh" "$@"
