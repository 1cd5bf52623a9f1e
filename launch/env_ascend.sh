#!/usr/bin/env bash
# Source on Ascend clusters before launch/run_node.sh (CANN toolkit + HCCL settings used by MindSpeed-RL DAPO runs).
# Unverified on our machines (no NPU): values follow the CANN / MindSpeed-RL documentation.
CANN_HOME=${CANN_HOME:-/usr/local/Ascend/ascend-toolkit}
# shellcheck disable=SC1091
[ -f "$CANN_HOME/set_env.sh" ] && source "$CANN_HOME/set_env.sh"
# shellcheck disable=SC1091
[ -f /usr/local/Ascend/nnal/atb/set_env.sh ] && source /usr/local/Ascend/nnal/atb/set_env.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1800}
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-3600}
export HCCL_IF_BASE_PORT=${HCCL_IF_BASE_PORT:-48890}
export HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-256}
export HCCL_SOCKET_IFNAME=${HCCL_SOCKET_IFNAME:-eth0}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}
export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-2}
export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}
# PYTORCH_NPU_ALLOC_CONF is deliberately NOT set to expandable_segments:True: vllm-ascend's sleep mode (its
# CaMemAllocator, used to free the rollout engine's memory between phases) asserts that expandable segments are off.
if [[ "${PYTORCH_NPU_ALLOC_CONF:-}" == *expandable_segments:True* ]]; then
  echo "env_ascend.sh: unsetting PYTORCH_NPU_ALLOC_CONF=$PYTORCH_NPU_ALLOC_CONF (vllm-ascend sleep mode refuses expandable segments)" >&2
  unset PYTORCH_NPU_ALLOC_CONF
fi
export VLLM_ENABLE_GRAPH_MODE=${VLLM_ENABLE_GRAPH_MODE:-0}
# NPROC_PER_NODE: left to launch/run_node.sh, which detects the device kind (A2: 8 per node, A3: 16).
