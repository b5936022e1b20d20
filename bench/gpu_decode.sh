#!/usr/bin/env bash
# Run on the GPU machine from the repository root (device tool): decode vs floor at the Qwen3-8B
# shape, XLA-flag variants, SmolLM2-135M-shaped tokens/s at batch 1/8/32, and tree verification
# (variant `verify`). Logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# convert/ and pallas_kernels/ install as weaver_jax.convert / .pallas_kernels: links give the same paths
for sub in convert pallas_kernels; do [ -e weaver_jax/$sub ] || ln -s ../$sub weaver_jax/$sub; done
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
    python3 bench/tree_attention.py --nodes 1 16 64 256 --json "$OUT/tree_attention.json" ;;
  tree-attention-sweep)  # tile and launch parameters of the tree-attention kernel (issue 8's tuning)
    python3 bench/tree_attention.py --prefix 4096 16384 --nodes 64 --batch 1 --block-r 64 128 --block-k 64 128 \
      --warps 4 8 --stages 2 3 --json "$OUT/tree_attention_sweep.json" ;;
  verify-kernels)  # whole verification with the target's attention through XLA vs the Pallas kernel (issue 8)
    python3 bench/verify.py --shape qwen3-8b --contexts 1024 4096 16384 --kernels off on --stages verify \
      --nodes 16 64 256 --json "$OUT/verify_kernels_qwen3-8b.json" ;;
  accept)  # one round's stages at budget 64, B = 1 and 8, XLA vs the Pallas kernels (issue 8's acceptance + commit goal)
    for b in 1 8; do
      python3 bench/verify.py --shape qwen3-8b --batch $b --contexts 1024 --kernels off on --stages round --methods weaver \
        --json "$OUT/round_qwen3-8b_b$b.json"
    done ;;
  round-smollm2)  # one round's stages at the SmolLM2 shape with the shipped drafter/adapter sizes (issue 5),
    # kernels off and on, Weaver's tree in ~16 adapter calls (the default) or ~8
    for calls in 16 8; do
      python3 bench/verify.py --shape smollm2-135m --contexts 512 --kernels off on --stages verify round \
        --nodes 16 64 --calls $calls --drafter-layers 2 --drafter-features 3 --adapter-rank 192 \
        --adapter-heads 3 --adapter-mlp 512 --json "$OUT/round_smollm2_calls_$calls.json"
    done ;;
  issue8)  # tree-attention tiles at N = 64 and N = 1 (4K, 16K), then whole verification (1K, 16K) and one
    # round's acceptance + commit (B = 1, 8) with the winning N = 64 tiles; kernels off vs on
    timeout 170 python3 bench/tree_attention.py --prefix 4096 16384 --nodes 64 --batch 1 --block-r 64 128 \
      --block-k 64 128 --programs 264 1024 --warps 4 8 --stages 3 --json "$OUT/sweep_n64.json"
    timeout 70 python3 bench/tree_attention.py --prefix 4096 16384 --nodes 1 --batch 1 --block-k 64 128 \
      --programs 264 1024 4096 --stages 3 --json "$OUT/sweep_n1.json"
    best=$(python3 bench/tree_attention.py --pick "$OUT/sweep_n64.json" || echo '{}')
    echo "tiles: $best"
    timeout 140 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels off on --stages verify \
      --nodes 64 --kernel-options "{\"tree_attention\": $best}" --json "$OUT/verify_kernels.json"
    for b in 8 1; do
      timeout 100 python3 bench/verify.py --shape qwen3-8b --batch $b --contexts 1024 --kernels off on --stages round \
        --methods weaver --kernel-options "{\"tree_attention\": $best}" --json "$OUT/round_b$b.json"
    done ;;
  issue8-final)  # the tuned defaults: acceptance + commit (B = 8), the tree-attention table, whole verification
    timeout 100 python3 bench/verify.py --shape qwen3-8b --batch 8 --contexts 1024 --kernels off on --stages round \
      --methods weaver --json "$OUT/round_b8.json"
    timeout 150 python3 bench/tree_attention.py --nodes 1 16 64 256 --steps 50 --json "$OUT/tree_attention.json"
    timeout 100 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels off on --stages verify \
      --nodes 64 --json "$OUT/verify_kernels.json" ;;
  tree-attention-profile)  # Nsight Compute on one XLA and one kernel call at 4K, N = 64: time, SM / tensor-pipe
    # use and occupancy per launch. Without preallocation: ncu saves and restores the memory in use around
    # each replay, and JAX's default 75% of the GPU made that time out
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    timeout 150 ncu --clock-control none -k regex:"tree_attention|fusion" --section SpeedOfLight --section Occupancy \
      --section LaunchStats python3 bench/tree_attention.py --prefix 4096 --nodes 64 --batch 1 --once \
      > "$OUT/ncu_tree_attention.txt" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy" \
      "$OUT/ncu_tree_attention.txt" | tail -60
    timeout 90 ncu --clock-control none -k regex:tree_attention_partials --metrics \
      sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,sm__inst_executed_pipe_tensor_op_hmma.sum \
      python3 bench/tree_attention.py --prefix 16384 --nodes 64 --batch 1 --once > "$OUT/ncu_tensor_pipes.txt" 2>&1
    tail -12 "$OUT/ncu_tensor_pipes.txt" ;;
  accept-in-flight)  # the acceptance kernel's move with 1 / 8 (the default since this run) / 24 cache arrays' loads in flight
    for n in 1 8 24; do
      timeout 80 python3 bench/verify.py --shape qwen3-8b --batch 8 --contexts 1024 --kernels on --stages round \
        --methods weaver --kernel-options "{\"accept_commit\": {\"layers_in_flight\": $n, \"num_warps\": $((n > 1 ? 4 : 1))}}" \
        --json "$OUT/accept_in_flight_$n.json"
    done ;;
  issue8-v3)  # tree attention v3 (q / output in place, unmasked whole blocks, exp2, merge of 16 columns per load,
    # 2 stages): the table at row blocks 64 / 128, SmolLM2's heads, whole verification (Qwen3-8B 1K / 16K,
    # SmolLM2 512) kernels off vs on. About 9 minutes: run the table alone if time is short
    timeout 330 python3 bench/tree_attention.py --nodes 16 64 256 --block-r 64 128 --steps 50 \
      --json "$OUT/tree_attention.json" > "$OUT/tree_attention.jsonl"
    timeout 60 python3 bench/tree_attention.py --heads 9 3 64 --prefix 512 2048 --nodes 16 64 --batch 1 \
      --json "$OUT/tree_attention_smollm2.json"
    timeout 110 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels off on --stages verify \
      --nodes 64 --json "$OUT/verify_qwen.json" 2> "$OUT/verify_qwen.err"
    timeout 60 python3 bench/verify.py --shape smollm2-135m --contexts 512 --kernels off on --stages verify \
      --nodes 16 64 --json "$OUT/verify_smollm2.json" 2> "$OUT/verify_smollm2.err"
    tail -c 1500 "$OUT"/verify_*.err ;;
  issue8-tiles)  # what v3's numbers left open, all with --steps 30: the harness (1 call per loop iteration vs 8
    # chained, as a forward chains its layers), row blocks x programs at B = 1 (N = 64, and N = 256 where v3
    # regressed), larger tiles at 16K, and the kernel at N = 1 (Qwen3-8B and SmolLM2 heads: may decode use it?)
    ta="timeout 200 python3 bench/tree_attention.py --steps 30 --batch 1"
    $ta --nodes 64 --prefix 4096 16384 --layers 1 --json "$OUT/layers1.json" > "$OUT/log.txt"
    $ta --nodes 64 --prefix 4096 16384 --block-r 64 128 --programs 132 264 528 --json "$OUT/programs_n64.json" >> "$OUT/log.txt"
    $ta --nodes 256 --prefix 16384 --block-r 128 --programs 264 528 --json "$OUT/programs_n256.json" >> "$OUT/log.txt"
    $ta --nodes 64 --prefix 16384 --block-r 128 --block-k 64 128 --warps 4 8 --json "$OUT/tiles_16k.json" >> "$OUT/log.txt"
    $ta --nodes 1 --prefix 4096 16384 --batch 1 8 --json "$OUT/n1_qwen.json" >> "$OUT/log.txt"
    $ta --heads 9 3 64 --nodes 1 --prefix 512 2048 --batch 1 8 --json "$OUT/n1_smollm2.json" >> "$OUT/log.txt" ;;
  issue8-rules)  # the row-block and split rules chosen from issue8-tiles, against v3's tiles in the same run:
    # whole verification (Qwen3-8B 1K / 16K; decode steps now through the kernel too), SmolLM2's decode step,
    # the tree-attention table, J around the rule
    timeout 200 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels off on --stages verify \
      --nodes 64 --json "$OUT/verify_qwen3-8b.json" > "$OUT/log.txt"
    timeout 60 python3 bench/verify.py --shape smollm2-135m --contexts 512 --kernels off on --stages verify \
      --nodes 64 --json "$OUT/verify_smollm2.json" >> "$OUT/log.txt"
    timeout 230 python3 bench/tree_attention.py --steps 30 --v3 --json "$OUT/table.json" >> "$OUT/log.txt"
    ta="timeout 60 python3 bench/tree_attention.py --steps 30 --batch 1"
    $ta --nodes 256 --prefix 16384 --splits 3 4 7 --json "$OUT/splits_n256.json" >> "$OUT/log.txt"
    $ta --nodes 64 --prefix 4096 --splits 7 8 --json "$OUT/splits_4k.json" >> "$OUT/log.txt" ;;
  issue8-split-cap)  # the rules with splits of at least 4 x block_r keys (after issue8-rules): whole verification
    # (kernels on; its XLA baseline in issue8-rules), row blocks x splits at 1K, the table against v3's tiles
    timeout 150 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels on --stages verify \
      --nodes 64 --json "$OUT/verify_qwen3-8b.json" > "$OUT/log.txt"
    timeout 90 python3 bench/tree_attention.py --steps 30 --batch 1 --prefix 1024 --nodes 64 256 --block-r 64 128 \
      --splits 1 2 4 7 --json "$OUT/sweep_1k.json" >> "$OUT/log.txt"
    timeout 330 python3 bench/tree_attention.py --steps 30 --v3 --json "$OUT/table.json" >> "$OUT/log.txt" ;;
  issue8-busy-splits)  # prefix splits chosen per sequence at run time (after issue8-split-cap): whole verification
    # (kernels on), the B = 1 table against v3's tiles, and a 1K prefix in a 16K cache
    timeout 130 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels on --stages verify \
      --nodes 64 --json "$OUT/verify_qwen3-8b.json" > "$OUT/log.txt"
    timeout 170 python3 bench/tree_attention.py --steps 30 --batch 1 --v3 --json "$OUT/table_b1.json" >> "$OUT/log.txt"
    timeout 40 python3 bench/tree_attention.py --steps 30 --batch 1 --prefix 1024 --nodes 64 --cache 16384 --v3 \
      --json "$OUT/cache16k.json" >> "$OUT/log.txt" ;;
  issue8-recheck)  # the committed rules where the last calls timed a neighbour (J capped by the cache: 1K rows,
    # verification at 1K), with the XLA baselines in the same run. About 5 minutes
    timeout 200 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels off on --stages verify \
      --nodes 64 --json "$OUT/verify_qwen3-8b.json" > "$OUT/log.txt"
    timeout 90 python3 bench/tree_attention.py --steps 30 --batch 1 --prefix 1024 4096 --v3 \
      --json "$OUT/table_b1.json" >> "$OUT/log.txt" ;;
  issue8-profile)  # whole verification with the cache carried (in place, as generate runs it), where its time goes
    # per kernel beside a decode step's, and float32 vs bfloat16 partial outputs with each launch's GPU time
    timeout 200 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels off on --stages verify \
      --nodes 64 --json "$OUT/verify_qwen3-8b.json" > "$OUT/log.txt"
    timeout 150 python3 bench/kernel_times.py --contexts 1024 16384 --nodes 1 64 --kernels on \
      --json "$OUT/kernel_times.json" >> "$OUT/log.txt"
    timeout 170 python3 bench/tree_attention.py --steps 30 --batch 1 8 --prefix 1024 4096 16384 --nodes 64 \
      --partials-dtype float32 bfloat16 --profile --json "$OUT/tree_attention.json" >> "$OUT/log.txt" ;;
  issue8-gemm)  # verification vs a decode step (bf16 partials now the default) with XLA's GEMM choices as they are,
    # with split-K off (its partial sums cost a reduction kernel the autotuner does not time), and with cuBLAS only;
    # GPU time per kernel at 1K for the first two, each kernel's HLO beside it
    for flags in "" "--xla_gpu_experimental_force_split_k=1" "--xla_gpu_enable_triton_gemm=false"; do
      echo "{\"xla_flags\": \"$flags\"}" >> "$OUT/log.txt"
      XLA_FLAGS="$flags" timeout 110 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels on \
        --stages verify --nodes 64 >> "$OUT/log.txt"
    done
    timeout 80 python3 bench/kernel_times.py --contexts 1024 --nodes 1 64 --steps 10 --json "$OUT/kernel_times.json" \
      > /dev/null
    XLA_FLAGS=--xla_gpu_experimental_force_split_k=1 timeout 80 python3 bench/kernel_times.py --contexts 1024 \
      --nodes 1 64 --steps 10 --json "$OUT/kernel_times_split_k_1.json" > /dev/null ;;
  issue8-spec-options)  # the round's stages compiled without split-K GEMMs vs XLA's defaults (the decode step keeps the
    # defaults): whole verification at 1K / 16K (twice), one round's stages at B = 1 / 8 (Qwen3-8B) and at SmolLM2's shape
    nosplit='{"xla_gpu_experimental_force_split_k": 1}'
    for run in 1 2; do
      timeout 130 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels on --stages verify \
        --nodes 64 --round-compiler-options "$nosplit" '{}' --json "$OUT/verify_run$run.json" >> "$OUT/log.txt"
    done
    for b in 1 8; do
      timeout 110 python3 bench/verify.py --shape qwen3-8b --batch $b --contexts 1024 --kernels on --stages round \
        --methods weaver --round-compiler-options "$nosplit" '{}' --json "$OUT/round_b$b.json" >> "$OUT/log.txt"
    done
    timeout 80 python3 bench/verify.py --shape smollm2-135m --contexts 512 --kernels on --stages verify round \
      --nodes 16 64 --drafter-layers 2 --drafter-features 3 --adapter-rank 192 --adapter-heads 3 --adapter-mlp 512 \
      --methods weaver --round-compiler-options "$nosplit" '{}' --json "$OUT/round_smollm2.json" >> "$OUT/log.txt" ;;
  issue8-bf16-partials)  # the tree-attention table with bfloat16 partial outputs (the default now) and float32 in the
    # same run, N = 1 / 16 / 64 / 256; then J + 1 = 16 (one merge chunk) against J = 16 at 16K, N = 64
    timeout 330 python3 bench/tree_attention.py --nodes 1 16 64 256 --steps 30 --partials-dtype bfloat16 float32 \
      --json "$OUT/table.json" > "$OUT/log.txt"
    timeout 90 python3 bench/tree_attention.py --prefix 16384 --nodes 64 --batch 1 --splits 15 16 --profile \
      --json "$OUT/splits.json" >> "$OUT/log.txt" ;;
  issue8-cache-write)  # the target's cache write as one scatter (the library's now) vs the vmapped
    # dynamic_update_slice before it, same run: decode step and verification of 64 nodes at 1K / 16K; GPU time per kernel
    timeout 170 python3 bench/verify.py --shape qwen3-8b --contexts 1024 16384 --kernels on --stages verify --nodes 64 \
      --cache-write scatter dus --json "$OUT/verify.json" > "$OUT/log.txt"
    timeout 80 python3 bench/kernel_times.py --contexts 1024 --nodes 1 64 --steps 10 --json "$OUT/kernel_times.json" \
      > /dev/null ;;
  issue17-profile)  # where a round's time goes per stage, through generate's jitted function (random SmolLM2-shaped
    # target, shipped drafter and adapter, EOS off): B = 1 every method, B = 8 a few; then the Qwen3-8B round's stages
    timeout 260 python3 bench/round_profile.py --random-target smollm2-135m --batch 1 --config ar dflash \
      ddtree:budget=64 weaver:budget=64 weaver:budget=64,expansions_per_call=8 weaver:budget=64,expansions_per_call=16 \
      weaver:budget=32 --json "$OUT/round_profile_smollm2_b1.json" 2>&1 | grep -v "^\[" | tee "$OUT/log.txt"
    timeout 120 python3 bench/round_profile.py --random-target smollm2-135m --batch 8 --config ar dflash \
      weaver:budget=64,expansions_per_call=8 --json "$OUT/round_profile_smollm2_b8.json" 2>&1 | grep -v "^\[" \
      | tee -a "$OUT/log.txt"
    timeout 150 python3 bench/verify.py --shape qwen3-8b --contexts 1024 --kernels on --stages round tree --nodes 64 \
      --budgets 64 --json "$OUT/round_qwen3-8b.json" 2>&1 | tail -8 | tee -a "$OUT/log.txt" ;;
  issue17-search-kernels)  # the Weaver search kernels' launch options against XLA's search, the default settings
    # (budget 24, 8 nodes per call), random SmolLM2-shaped target: no GGUF staging needed. Each run compiles and
    # profiles; ~2 min each (a 100 s limit cut one off before it printed)
    base="weaver:budget=24,expansions_per_call=8"
    configs="$base $base@all"  # the XLA search once, then the kernels under each option set
    for o in '{}' '{"weaver_search": {"num_warps": 8}}' '{"weaver_search": {"num_warps": 8, "num_stages": 3}}'; do
      timeout 170 python3 bench/round_profile.py --random-target smollm2-135m --batch 1 --config $configs \
        --kernel-options "$o" --json "$OUT/search_kernels_$(echo "$o" | tr -dc 'a-z0-9').json" 2>&1 | grep '^{' \
        | tee -a "$OUT/log.txt"
      configs="$base@all"
    done ;;
  issue17-levers)  # the default Weaver round (budget 24, 8 per call) stage by stage with its optimized HLO, under XLA
    # flag variants, with the search kernels under 8 warps / 3 stages; then the Qwen3-8B round at the new default
    base="weaver:budget=24,expansions_per_call=8"
    rp() { timeout "$1" python3 bench/round_profile.py --random-target smollm2-135m --batch 1 "${@:2}" 2>&1 | grep -v "^\[" \
      | cut -c1-1500 | tee -a "$OUT/log.txt"; }
    rp 150 --config ar dflash $base --hlo-dir "$OUT/hlo" --json "$OUT/levers_base.json"
    rp 80 --config $base@all --kernel-options '{"weaver_search": {"num_warps": 8, "num_stages": 3}}' \
      --json "$OUT/levers_search_w8s3.json"
    for flags in --xla_gpu_enable_triton_gemm=false --xla_gpu_graph_enable_concurrent_region=true; do
      echo "XLA_FLAGS=$flags" | tee -a "$OUT/log.txt"
      XLA_FLAGS=$flags rp 110 --config ar dflash $base --json "$OUT/levers_$(echo "$flags" | tr -dc 'a-z_').json"
    done
    timeout 120 python3 bench/verify.py --shape qwen3-8b --contexts 1024 --kernels on --stages round --nodes 24 \
      --budgets 24 --calls 3 --json "$OUT/round_qwen3-8b_default.json" 2>&1 | tail -8 | tee -a "$OUT/log.txt" ;;
  flags)  # XLA command buffers (CUDA graphs) around the while loop: fewer launch gaps for small models
    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
      python3 bench/decode.py --shape smollm2-135m --batch 1 32 --label cmdbuf-while --json "$OUT/smollm2_cmdbuf.json" ;;
esac
