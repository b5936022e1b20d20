#!/usr/bin/env bash
# Issue 5 on the GPU machine, as back-to-back device calls from the repository root. Files outside
# the repository copy survive between calls only while the machine stays warm (~30 s, DESIGN 4), so
# the target GGUF is staged in $STAGE in parts and every stage keeps its outputs there too (and
# copies them to $OUT, so a cold machine can be re-seeded by carrying them back).
#
#   bash bench/gpu_train.sh stage                 # carry .stage/gguf/part-N (+ .whl): store, check, assemble
#                                                 # (parts: `split -n 3 -d -a 1 SmolLM2...gguf .stage/gguf/part-`)
#   bash bench/gpu_train.sh data                  # carry .stage/prompts: the target's own responses
#   bash bench/gpu_train.sh drafter STEPS MINUTES
#   bash bench/gpu_train.sh adapter STEPS MINUTES
#   KEEP_EVERY=500 DISTILL=0.5 MAX_SEQUENCES=4000 bash bench/gpu_train.sh drafter ...   # keep curve points;
#                                                 # mix in the target's KL; a data subset (τ against data size)
#   bash bench/gpu_train.sh curve drafter "500 1000" 0   # τ of the drafter at kept steps (chain, DDTree-64;
#                                                 # curve adapter: Weaver-64 with the exported drafter)
#   bash bench/gpu_train.sh tau "0 1"             # tau on the held-out sets at these temperatures (~70 s per
#                                                 # method and budget: a call finishes ~7; rerun to continue;
#                                                 # TAU_BUDGETS="64" to take those budgets first)
#   bash bench/gpu_train.sh e2e "1 8" 0 "ar dflash weaver:budget=64"   # bench/e2e.py: tokens/s vs ar through
#                                                 # generate, 48 held-out prompts (carry .stage/eval/eval_prompts.json;
#                                                 # E2E_ARGS: more e2e.py options, E2E_LABEL: a suffix for its JSON)
#   bash bench/gpu_train.sh profile 1 "ar weaver:budget=64"            # bench/round_profile.py on the real pair
#   bash bench/gpu_train.sh agreement "dflash weaver"                  # bench/agreement.py: same tokens as ar,
#                                                 # default mode and exact=1, differences explained (AGREE_PER_SET)
#
# Several stages can be chained in one call: `bash bench/gpu_train.sh stage data drafter 3000 6`. Chain
# them in one invocation: the stages' time limits count from the script's start ($SECONDS), so a
# second invocation in the same call would think it has the whole 10 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1
STAGE=${WEAVER_STAGE:-$HOME/weaver_stage}
OUT=${OUT:-$STAGE/out}
GGUF=$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf
SUMS=bench/smollm2_gguf.sha256
mkdir -p "$STAGE" "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/gguf ]; then  # gguf is not on the GPU image
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
# convert/ and pallas_kernels/ install as weaver_jax.convert / .pallas_kernels; without an install,
# links in this (throw-away) copy of the repository give the same import paths.
for sub in convert pallas_kernels; do [ -e weaver_jax/$sub ] || ln -s ../$sub weaver_jax/$sub; done
export JAX_COMPILATION_CACHE_DIR=$STAGE/jax_cache  # a resumed stage in a later call skips recompiling
W="python3 -m weaver_jax.cli"
# tau, e2e and profile use this session's exports when they exist, else the shipped drafter and adapter
SHIPPED=weaver_jax/weights/smollm2-135m-instruct
DRAFTER=$STAGE/export/drafter; [ -d "$DRAFTER" ] || DRAFTER=$SHIPPED/drafter
ADAPTER=$STAGE/export/adapter; [ -d "$ADAPTER" ] || ADAPTER=$SHIPPED/adapter
minutes_left() {  # what remains of a 10-minute call, less a margin for export and packing
  python3 -c "print(max(0.5, min($1, (555 - $SECONDS) / 60 - 0.6)))"
}

stage() {  # store the carried parts, say what has arrived and what is missing, assemble when complete
  cp .stage/gguf/part-* "$STAGE/" 2>/dev/null
  local missing=0
  while read -r sum name; do
    [ "$name" = "$(basename "$GGUF")" ] && continue
    if [ ! -f "$STAGE/$name" ]; then echo "missing: $name (carry .stage/gguf/$name)"; missing=1
    elif [ "$(sha256sum "$STAGE/$name" | cut -d' ' -f1)" != "$sum" ]; then echo "corrupt: $name"; rm -f "$STAGE/$name"; missing=1
    else echo "have: $name"; fi
  done < "$SUMS"
  [ $missing = 1 ] && return 0
  cat "$STAGE"/part-* > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
  if [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$(grep "$(basename "$GGUF")" "$SUMS" | cut -d' ' -f1)" ]; then
    echo "assembled: $GGUF"
  else echo "assembled file has the wrong checksum"; rm -f "$GGUF"; return 1; fi
}

need_gguf() { [ -f "$GGUF" ] || { echo "the target is not staged: run 'stage' with all parts first"; exit 1; }; }

pack() {  # pack a directory into $OUT in pieces under 15 MiB (the tool returns files of <= 16 MiB)
  tar czf - -C "$(dirname "$2")" "$(basename "$2")" | split -b 15m -d -a 1 - "$OUT/$1.tgz."
}

while [ $# -gt 0 ]; do
  case "$1" in
    stage) stage || exit 1; shift ;;
    data)
      need_gguf
      $W train-data .stage/prompts/prompts.json "$STAGE/data" --model "$GGUF" --batch 512 --sampled-copies 1 \
        2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -5
      pack data "$STAGE/data"; shift ;;
    drafter)
      need_gguf
      $W train-drafter "$STAGE/data" "$STAGE/runs/drafter" --model "$GGUF" --steps "$2" --max-minutes "$(minutes_left "$3")" \
        --batch-size 32 --anchors 32 --save-every 500 --keep-every "${KEEP_EVERY:-0}" --distill "${DISTILL:-0}" \
        --max-sequences "${MAX_SEQUENCES:-0}" --export "$STAGE/export/drafter" 2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -5
      tail -n 3 "$STAGE/runs/drafter/log.jsonl"
      cp "$STAGE/runs/drafter/log.jsonl" "$OUT/drafter_log.jsonl"
      [ -d "$STAGE/export/drafter" ] && pack drafter "$STAGE/export/drafter"
      shift 3 ;;
    adapter)
      need_gguf
      $W train-adapter "$STAGE/data" "$STAGE/runs/adapter" --model "$GGUF" --drafter "$STAGE/export/drafter" \
        --steps "$2" --max-minutes "$(minutes_left "$3")" --batch-size 16 --anchors 32 --save-every 500 \
        --keep-every "${KEEP_EVERY:-0}" --distill "${DISTILL:-0}" --max-sequences "${MAX_SEQUENCES:-0}" \
        --export "$STAGE/export/adapter" \
        2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -5
      tail -n 3 "$STAGE/runs/adapter/log.jsonl"
      cp "$STAGE/runs/adapter/log.jsonl" "$OUT/adapter_log.jsonl"
      [ -d "$STAGE/export/adapter" ] && pack adapter "$STAGE/export/adapter"
      shift 3 ;;
    tau)  # tau TEMPERATURE...: no autotuning (compile time dominates; tau does not depend on kernel choice)
      need_gguf
      # resume from the committed results (configurations already there are skipped)
      [ -f "$STAGE/tau.json" ] || cp "${TAU_SEED:-bench/results/2026-11-30_smollm2_tau_h200.json}" "$STAGE/tau.json"
      # stop before the call's limit so the results reach $OUT; finished configurations are kept
      XLA_FLAGS="--xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout $((560 - SECONDS))s \
        python3 bench/tau.py --model "$GGUF" --drafter "$DRAFTER" --adapter "$ADAPTER" --temperatures $2 \
        --budgets ${TAU_BUDGETS:-16 32 64 128} \
        --eval-prompts .stage/prompts/eval_prompts.json --json "$STAGE/tau.json" 2>&1 | grep -v "^\[" | tail -8
      cp "$STAGE/tau.json" "$OUT/tau.json"  # carry it back as .stage/tau.json to resume on a fresh machine
      shift 2 ;;
    curve)  # curve KIND STEPS TEMPERATURES: τ at kept steps of $STAGE/runs/KIND (train with KEEP_EVERY)
      need_gguf
      for step in $3; do
        point=$STAGE/curve/$2-$step
        [ -d "$point" ] || $W train-export "$2" "$STAGE/runs/$2" "$point" --step "$step" || exit 1
        if [ "$2" = drafter ]; then models=(--drafter "$point" --adapter "$ADAPTER" --methods dflash ddtree)
        else models=(--drafter "$DRAFTER" --adapter "$point" --methods weaver); fi
        XLA_FLAGS="--xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout $((560 - SECONDS))s \
          python3 bench/tau.py --model "$GGUF" "${models[@]}" --temperatures $4 --budgets ${TAU_BUDGETS:-64} \
          --eval-prompts .stage/prompts/eval_prompts.json --json "$STAGE/curve_$2_$step.json" 2>&1 | grep -v "^\[" | tail -4
        cp "$STAGE/curve_$2_$step.json" "$OUT/"
      done
      shift 4 ;;
    e2e)  # e2e BATCHES TEMPERATURES CONFIGS
      need_gguf
      timeout $((570 - SECONDS)) python3 bench/e2e.py --model "$GGUF" --drafter "$DRAFTER" --adapter "$ADAPTER" \
        --eval-prompts .stage/eval/eval_prompts.json --batch $2 --temperatures $3 --config $4 ${E2E_ARGS:-} \
        --json "$OUT/e2e_$(echo "$2_$3" | tr ' .' '-p')${E2E_LABEL:-}.json" 2>&1 | grep -v "^\[\|^W1\|^I1"
      shift 4 ;;
    agreement)  # agreement CONFIGS: bench/agreement.py, default mode and exact, differences explained
      need_gguf
      timeout $((570 - SECONDS)) python3 bench/agreement.py --model "$GGUF" --drafter "$DRAFTER" --adapter "$ADAPTER" \
        --eval-prompts .stage/eval/eval_prompts.json --per-set ${AGREE_PER_SET:-8} --config $2 \
        --json "$OUT/agreement.json" 2>&1 | grep -v "^\[\|^W1\|^I1"
      shift 2 ;;
    profile)  # profile BATCH CONFIGS
      need_gguf
      timeout $((570 - SECONDS)) python3 bench/round_profile.py --model "$GGUF" --drafter "$DRAFTER" \
        --adapter "$ADAPTER" --batch "$2" --config $3 --json "$OUT/round_profile_b$2.json" 2>&1 | grep -v "^\[\|^W1\|^I1"
      shift 3 ;;
    probe)  # training step times at the SmolLM2 shape (random weights), to size the runs
      python3 bench/train_probe.py --steps 12 --drafter-batches 32 --adapter-batches 16 --json "$OUT/train_probe.json" \
        2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -4; shift ;;
    tree) python3 bench/tree_build.py --json "$OUT/tree_build.json"; shift ;;
    *) echo "unknown stage $1"; exit 2 ;;
  esac
done
