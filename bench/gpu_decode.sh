#!/usr/bin/env bash
# Run on the GPU machine from the repository root (device tool): decode vs floor at the Qwen3-8B
# shape, XLA-flag variants, SmolLM2-135M-shaped tokens/s at batch 1/8/32, and tree verification
# (variant `verify`). Logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
variant=${1:-default}
case "$variant" in
  default)
    python3 bench/decode.py --shape qwen3-8b --batch 1 8 --label default --json "$OUT/qwen3-8b_default.json"
    python3 bench/decode.py --shape smollm2-135m --batch 1 8 32 --label default --json "$OUT/smollm2_default.json" ;;
  qwen)
    python3 bench/decode.py --shape qwen3-8b --batch 1 8 --label default --json "$OUT/qwen3-8b_default.json" ;;
  verify)  # tree verification vs a decode step, and the per-round breakdown (issue 3)
    python3 bench/verify.py --shape qwen3-8b --json "$OUT/verify_qwen3-8b.json" ;;
  tree)  # where Weaver's tree-construction time goes (issue 4), plain and with XLA command buffers
    python3 bench/tree_build.py --json "$OUT/tree_build.json"
    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
      python3 bench/tree_build.py --label cmdbuf --budgets 64 --expansions 4 --json "$OUT/tree_build_cmdbuf.json" ;;
  tree-attention)  # the Pallas tree-attention kernel against XLA and the K/V read floor (issue 8)
    python3 bench/tree_attention.py --json "$OUT/tree_attention.json" ;;
  flags)  # XLA command buffers (CUDA graphs) around the while loop: fewer launch gaps for small models
    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
      python3 bench/decode.py --shape smollm2-135m --batch 1 32 --label cmdbuf-while --json "$OUT/smollm2_cmdbuf.json" ;;
esac
