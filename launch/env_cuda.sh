#!/usr/bin/env bash
# Source on NVIDIA clusters before launch/run_node.sh.
export CUDA_DEVICE_MAX_CONNECTIONS=1          # megatron-core: ordered TP/SP communication kernels
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
# NPROC_PER_NODE: left to launch/run_node.sh (nvidia-smi -L | wc -l).
