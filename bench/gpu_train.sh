#!/usr/bin/env bash
# Training and measuring the SmolLM2 pair on the GPU machine, as back-to-back device calls from the
# repository root. Files outside the repository copy survive between calls only while the machine stays
# warm (~30 s, DESIGN 4), so the target GGUF is staged in $STAGE in pieces and every stage keeps its
# outputs there too (and sends them back through $OUT, so a later session can carry them in again).
#
#   bash bench/gpu_train.sh stage                 # carry .stage/carry pieces (+ .whl): unpack, check the GGUF
#                                                 # (pieces made here by `bash bench/gpu_train.sh carry-gguf`;
#                                                 # or parts: `split -n 3 -d -a 1 ...gguf .stage/gguf/part-`)
#   bash bench/gpu_train.sh data                  # carry .stage/prompts (or its pieces: carry-prompts here):
#                                                 # the target's own responses
#                                                 # (SAMPLED_COPIES=2: two temperature-1 answers per prompt)
#                                                 # (DATA_LIMIT=N: N prompts of each kind, spread evenly)
#                                                 # (PROMPTS=NAME DATA_SEED=N: a second set of new prompts,
#                                                 # `PROMPTS=NAME carry-prompts` here; the seed samples
#                                                 # the target's written prompts afresh)
#   bash bench/gpu_train.sh eval-data             # the target's greedy answers to the held-out prompts: the
#                                                 # drafter / adapter stages then log eval_tau_chain etc. at
#                                                 # every checkpoint (a τ curve without decoding)
#   bash bench/gpu_train.sh save-run drafter      # pack runs/drafter's latest checkpoint to carry it back
#   bash bench/gpu_train.sh save-params drafter   # or only its parameters (float32, a third of save-run's
#                                                 # size: no Adam moments); a later session continues with
#   INIT=export/drafter-f32 ... bash bench/gpu_train.sh drafter ...   # (a warm start: --init, --init-step)
#   bash bench/gpu_train.sh send                  # the outbox's rest into $OUT (back-to-back calls; below)
#   bash bench/gpu_train.sh drafter STEPS MINUTES
#   bash bench/gpu_train.sh adapter STEPS MINUTES
#   KEEP_EVERY=500 DISTILL=0.5 MAX_SEQUENCES=4000 bash bench/gpu_train.sh drafter ...   # keep curve points;
#                                                 # mix in the target's KL; a data subset (τ against data size:
#                                                 # with RUN=4k, a side run in runs/drafter-4k, not exported);
#                                                 # DRAFTER_LAYERS=4; TRAIN_ARGS: more train-* options (--lr ...)
#   bash bench/gpu_train.sh curve drafter "500 1000" 0   # τ of the drafter at kept steps (chain, DDTree-64;
#                                                 # curve adapter: Weaver-64 with the exported drafter)
#   bash bench/gpu_train.sh tau "0 1"             # tau on the held-out sets at these temperatures (~70 s per
#                                                 # method and budget: a call finishes ~7; rerun to continue;
#                                                 # TAU_BUDGETS="64" to take those budgets first;
#                                                 # TAU_SEED=tau.json: continue one carried back; TAU_ARGS:
#                                                 # more tau.py options, e.g. "--weaver-options expansions_per_call=8")
#   bash bench/gpu_train.sh e2e "1 8" 0 "ar dflash weaver:budget=64"   # bench/e2e.py: tokens/s vs ar through
#                                                 # generate, 48 held-out prompts (the staged prompts, or
#                                                 # carry .stage/prompts; E2E_ARGS: more e2e.py options,
#                                                 # E2E_LABEL: a suffix for its JSON)
#   bash bench/gpu_train.sh profile 1 "ar weaver:budget=64"            # bench/round_profile.py on the real pair
#   bash bench/gpu_train.sh tune "1 8 32" "0 1"                       # weaver-jax tune (method="auto"'s costs), timed
#   bash bench/gpu_train.sh stream                                     # bench/stream.py: streaming's cost
#                                                 # (STREAM_ROUNDS="0 16": those rounds_per_call only)
#   bash bench/gpu_train.sh serve "weaver ar"                          # bench/serve_load.py (carry .whl: the stage says which;
#                                                 # SERVE_ARGS="--slot-call-seconds 0.1" SERVE_LABEL=_0.1: other settings)
#   bash bench/gpu_train.sh agreement "dflash weaver"                  # bench/agreement.py: same tokens as ar,
#                                                 # default mode and exact=1, differences explained (AGREE_PER_SET)
#
# Several stages can be chained in one call: `bash bench/gpu_train.sh stage data drafter 3000 6` (or several
# invocations after `export CALL_START=$(date +%s)`, below).
set -uo pipefail
export PYTHONUNBUFFERED=1
# The stages' time limits count from the call's start: `export CALL_START=$(date +%s)` before several
# invocations in one call (e.g. tau with different TAU_ARGS) and they share the call's 10 minutes.
export CALL_START=${CALL_START:-$(date +%s)}
SECONDS=$(($(date +%s) - CALL_START))
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
SHIPPED=weaver_jax/weights/smollm2-135m-instruct
model_dir() {  # model_dir drafter|adapter: this session's export once a stage (maybe earlier in this call)
  # made it, else the shipped one - what tau, e2e, profile and the adapter's training use
  if [ -d "$STAGE/export/$1" ]; then echo "$STAGE/export/$1"; else echo "$SHIPPED/$1"; fi
}
minutes_left() {  # what remains of a 10-minute call, less a margin for export and packing
  python3 -c "print(max(0.5, min($1, (555 - $SECONDS) / 60 - 0.6)))"
}

named_gguf() {  # the staged GGUF where `load("smollm2-135m-instruct")` looks (the benches that take a name)
  export WEAVER_JAX_CACHE=$STAGE/cache
  mkdir -p "$STAGE/cache/models" && ln -sf "$GGUF" "$STAGE/cache/models/"
}

gguf_ok() { [ -f "$GGUF" ] && [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$(grep "$(basename "$GGUF")" "$SUMS" | cut -d' ' -f1)" ]; }

stage() {  # the GGUF from carried pieces (unpack) or parts: say what has arrived and what is missing
  unpack
  if gguf_ok; then echo "staged: $GGUF"; return 0; fi
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
  if gguf_ok; then
    echo "assembled: $GGUF"
  else echo "assembled file has the wrong checksum"; rm -f "$GGUF"; return 1; fi
}

need_gguf() { [ -f "$GGUF" ] || { echo "the target is not staged: run 'stage' with every piece carried first"; exit 1; }; }

# Carrying state between sessions (a fresh machine has nothing): `pack NAME PATH...` puts PATHs (relative
# to $STAGE) in the outbox as NAME.tgz.NN pieces of 13 MiB with a NAME.sha256 manifest; every call ends
# with `send`, which moves into $OUT what one call may return (8 files, 64 MiB with what is there), and
# the `send` stage alone empties the rest in back-to-back calls. Here: copy each call's files into
# .stage/carry/; next session carry them (three pieces a call: ~41 MiB fit beside the repository) and
# `unpack` extracts every set whose manifest and pieces have all arrived (stage runs it too). The GGUF
# goes the same way: `bash bench/gpu_train.sh carry-gguf` here makes its pieces. The shipped weights are 30 of
# the tree's 38 MiB: with weaver_jax/weights moved aside here for the staging calls (nothing before `drafter`,
# `adapter`, `tau`, `e2e` reads them), four 13 MiB pieces travel per call, so the GGUF stages in two calls.
OUTBOX=$STAGE/outbox
pack() {
  local name=$1; shift
  mkdir -p "$OUTBOX"; rm -f "$OUTBOX/$name".tgz.* "$OUTBOX/$name.sha256"
  tar czf - -C "$STAGE" "$@" | split -b 13m -d -a 2 - "$OUTBOX/$name.tgz."
  (cd "$OUTBOX" && sha256sum "$name".tgz.* > "$name.sha256")
  echo "packed $name: $(ls "$OUTBOX/$name".tgz.* | wc -l) pieces, $(du -ch "$OUTBOX/$name".tgz.* | tail -1 | cut -f1)"
}

send() {
  [ -d "$OUTBOX" ] || return 0
  local files bytes f size
  files=$(find "$OUT" -type f | wc -l); bytes=$(find "$OUT" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  for f in $(ls "$OUTBOX" | sort); do  # a set's manifest (.sha256) sorts before its pieces (.tgz.NN)
    size=$(stat -c %s "$OUTBOX/$f")
    { [ $((files + 1)) -le 8 ] && [ $((bytes + size)) -le $((63 * 1048576)) ]; } || break
    mv "$OUTBOX/$f" "$OUT/"; files=$((files + 1)); bytes=$((bytes + size))
  done
  if [ -n "$(ls "$OUTBOX")" ]; then echo "outbox: $(ls "$OUTBOX" | wc -l) files left: call 'send' again while warm"
  else echo "outbox: empty"; fi
}

unpack() {  # the carried .stage/carry/NAME.* into the stage, once a set is complete and its sums check;
  # each set once per machine (NAME.done keeps its manifest): a later call that carries the same manifest
  # must not extract an old run over the training done since
  mkdir -p "$STAGE/inbox"; cp .stage/carry/* "$STAGE/inbox/" 2>/dev/null
  local manifest name
  for manifest in "$STAGE"/inbox/*.sha256; do
    [ -f "$manifest" ] || continue
    name=$(basename "$manifest" .sha256)
    cmp -s "$manifest" "$STAGE/inbox/$name.done" && continue
    if (cd "$STAGE/inbox" && sha256sum --quiet -c "$name.sha256" >/dev/null 2>&1); then
      cat "$STAGE/inbox/$name".tgz.* | tar xzf - -C "$STAGE" && echo "unpacked: $name" && cp "$manifest" "$STAGE/inbox/$name.done"
    else echo "waiting for pieces of $name: $(cd "$STAGE/inbox" && sha256sum -c "$name.sha256" 2>&1 | grep -c FAILED) missing or corrupt"; fi
  done
}

prompts() {  # the prompts directory: carried as pieces (`carry-prompts` here), else as the folder .stage/NAME
  local name=${1:-prompts}
  if [ -d "$STAGE/$name" ]; then echo "$STAGE/$name"; else echo ".stage/$name"; fi
}

latest_step() {  # the newest orbax step directory of a run (fails, saying so, when there is none)
  ls "$1" 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -1 | grep . || { echo "no checkpoint in $1" >&2; return 1; }
}

complete() {  # a finished train-data directory
  python3 -c "import sys; from weaver_jax._train_data import complete_parts; complete_parts(sys.argv[1])" "$1" 2>/dev/null
}

eval_args() {  # the held-out sequences of the eval-data stage, when made
  if complete "$STAGE/eval_data"; then echo --eval-data "$STAGE/eval_data"; fi
}

need_init() {  # INIT, when given, must name an unpacked checkpoint (else a run would start from scratch)
  [ -z "${INIT:-}" ] || [ -f "$STAGE/$INIT/config.json" ] || {
    echo "INIT=$INIT: no checkpoint at $STAGE/$INIT (unpacked? save-params writes export/KIND-f32)"; exit 1; }
}

init_args() {  # init_args KIND: INIT=path under the stage, a KIND checkpoint: a new run starts from its
  # parameters (see save-params); a checkpoint of the other kind is left to the other trainer's stage
  [ -n "${INIT:-}" ] || return 0
  grep -q "\"kind\": \"$1\"" "$STAGE/$INIT/config.json" 2>/dev/null || return 0
  echo --init "$STAGE/$INIT" --init-step "${INIT_STEP:-$(cat "$STAGE/$INIT.step" 2>/dev/null || echo 0)}"
}

run_name() {  # KIND, or with RUN=NAME KIND-NAME: a side run (the τ-against-data-size points: MAX_SEQUENCES)
  # that neither exports nor replaces export/KIND, which tau, e2e and the adapter's training read
  echo "$1${RUN:+-$RUN}"
}

export_args() {  # the export goes beside export/KIND, which may be this run's INIT, and replaces it when written
  rm -rf "$STAGE/export/$1.next"
  [ -n "${RUN:-}" ] || echo --export "$STAGE/export/$1.next"
}

finish_run() {  # finish_run KIND: the log back through $OUT (KIND-RUN_log.jsonl for a side run), the export packed
  local name; name=$(run_name "$1")
  tail -n 3 "$STAGE/runs/$name/log.jsonl"
  cp "$STAGE/runs/$name/log.jsonl" "$OUT/${name}_log.jsonl"
  [ -z "${RUN:-}" ] && [ -d "$STAGE/export/$1.next" ] || return 0
  rm -rf "$STAGE/export/$1.prev"; [ -d "$STAGE/export/$1" ] && mv "$STAGE/export/$1" "$STAGE/export/$1.prev"
  mv "$STAGE/export/$1.next" "$STAGE/export/$1" && pack "$1" "export/$1"
}

while [ $# -gt 0 ]; do
  case "$1" in
    carry-gguf)  # here, not on the GPU: the package's GGUF as pieces in .stage/carry (then carry 3 a call)
      src=$(.venv/bin/python -c 'from weaver_jax._load import _smollm2_gguf; print(_smollm2_gguf())') \
        || { echo "no $(basename "$GGUF"): run 'make .venv/.installed' first (it is fetched on first use)"; exit 1; }
      STAGE=$(dirname "$src") OUTBOX=.stage/carry pack gguf "$(basename "$GGUF")"; shift ;;
    carry-prompts)  # here: .stage/prompts (weaver-jax train-prompts) as pieces in .stage/carry; PROMPTS=NAME:
      # .stage/NAME's training prompts only (a second set: train-prompts --exclude)
      if [ -n "${PROMPTS:-}" ]; then STAGE=.stage OUTBOX=.stage/carry pack "$PROMPTS" "$PROMPTS/prompts.json"
      else STAGE=.stage OUTBOX=.stage/carry pack prompts prompts/prompts.json prompts/eval_prompts.json; fi; shift ;;
    stage) stage || exit 1; shift ;;
    unpack) unpack; shift ;;
    send) shift ;;  # send runs at the end of every call
    save-run)  # save-run KIND: runs/KIND (RUN=NAME: runs/KIND-NAME) with its latest checkpoint only (resume it
      # in a later session)
      name=$(run_name "$2"); run=runs/$name; step=$(latest_step "$STAGE/$run") || exit 1
      pack "run-$name" "$run/$step" $(cd "$STAGE" && ls -d "$run"/*.json* 2>/dev/null); shift 2 ;;
    save-params)  # save-params KIND: the latest step's parameters (float32) + the run's log, for INIT=export/KIND-f32
      # (with RUN=NAME: the side run runs/KIND-NAME, for INIT=export/KIND-NAME-f32)
      name=$(run_name "$2"); run=runs/$name; step=$(latest_step "$STAGE/$run") || exit 1
      rm -rf "$STAGE/export/$name-f32"
      $W train-export "$2" "$STAGE/$run" "$STAGE/export/$name-f32" --step "$step" --export-dtype float32 || exit 1
      echo "$step" > "$STAGE/export/$name-f32.step"  # the step a warm start continues from (INIT_STEP)
      pack "params-$name" "export/$name-f32" "export/$name-f32.step" "$run/log.jsonl" "$run/module.json"; shift 2 ;;
    data)  # resumable: parts done stay (while warm); packed for carrying once complete
      need_gguf
      timeout $((560 - SECONDS)) $W train-data "$(prompts "${PROMPTS:-}")/prompts.json" "$STAGE/data" --model "$GGUF" \
        --batch 512 --sampled-copies "${SAMPLED_COPIES:-1}" --limit "${DATA_LIMIT:-0}" --seed "${DATA_SEED:-0}" \
        2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -5
      if complete "$STAGE/data"; then
        pack data data
      else echo "data: $(ls "$STAGE/data" | grep -c '^part-') parts so far; run 'data' again to continue"; fi
      shift ;;
    eval-data)  # greedy answers to the held-out prompts (446: ~1 min), packed: a few hundred KB to carry
      need_gguf
      if ! complete "$STAGE/eval_data"; then
        $W train-data "$(prompts)/eval_prompts.json" "$STAGE/eval_data" --held-out --model "$GGUF" --batch 512 \
          2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -2
        complete "$STAGE/eval_data" && pack eval_data eval_data
      fi
      shift ;;
    drafter)
      need_gguf; need_init
      $W train-drafter "$STAGE/data" "$STAGE/runs/$(run_name drafter)" --model "$GGUF" --steps "$2" \
        --max-minutes "$(minutes_left "$3")" --batch-size 32 --anchors 32 --save-every 500 \
        --keep-every "${KEEP_EVERY:-0}" --distill "${DISTILL:-0}" --max-sequences "${MAX_SEQUENCES:-0}" \
        --layers "${DRAFTER_LAYERS:-2}" $(init_args drafter) $(eval_args) ${TRAIN_ARGS:-} $(export_args drafter) \
        2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -5
      finish_run drafter
      shift 3 ;;
    adapter)
      need_gguf; need_init
      $W train-adapter "$STAGE/data" "$STAGE/runs/$(run_name adapter)" --model "$GGUF" \
        --drafter "$(model_dir drafter)" --steps "$2" --max-minutes "$(minutes_left "$3")" --batch-size 16 \
        --anchors 32 --save-every 500 \
        --keep-every "${KEEP_EVERY:-0}" --distill "${DISTILL:-0}" --max-sequences "${MAX_SEQUENCES:-0}" \
        $(init_args adapter) $(eval_args) ${TRAIN_ARGS:-} $(export_args adapter) \
        2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -5
      finish_run adapter
      shift 3 ;;
    tau)  # tau TEMPERATURE...: no autotuning (compile time dominates; tau does not depend on kernel choice)
      need_gguf
      # TAU_SEED=FILE (a tau.json carried back): continue it (its configurations of the same drafter and
      # adapter paths are skipped)
      [ -f "$STAGE/tau.json" ] || [ -z "${TAU_SEED:-}" ] || cp "$TAU_SEED" "$STAGE/tau.json"
      # stop before the call's limit so the results reach $OUT; finished configurations are kept
      XLA_FLAGS="--xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout $((560 - SECONDS))s \
        python3 bench/tau.py --model "$GGUF" --drafter "$(model_dir drafter)" --adapter "$(model_dir adapter)" \
        --temperatures $2 --budgets ${TAU_BUDGETS:-16 32 64 128} ${TAU_ARGS:-} \
        --eval-prompts "$(prompts)/eval_prompts.json" --json "$STAGE/tau.json" 2>&1 | grep -v "^\[" | tail -8
      cp "$STAGE/tau.json" "$OUT/tau.json"  # carry it back as .stage/tau.json to resume on a fresh machine
      shift 2 ;;
    curve)  # curve KIND STEPS TEMPERATURES: τ at kept steps of $STAGE/runs/KIND (train with KEEP_EVERY)
      need_gguf
      for step in $3; do
        point=$STAGE/curve/$2-$step
        [ -d "$point" ] || $W train-export "$2" "$STAGE/runs/$2" "$point" --step "$step" || exit 1
        if [ "$2" = drafter ]; then
          models=(--drafter "$point" --adapter "$(model_dir adapter)" --methods dflash ddtree)
        else models=(--drafter "$(model_dir drafter)" --adapter "$point" --methods weaver); fi
        XLA_FLAGS="--xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout $((560 - SECONDS))s \
          python3 bench/tau.py --model "$GGUF" "${models[@]}" --temperatures $4 --budgets ${TAU_BUDGETS:-64} \
          --eval-prompts "$(prompts)/eval_prompts.json" --json "$STAGE/curve_$2_$step.json" 2>&1 | grep -v "^\[" | tail -4
        cp "$STAGE/curve_$2_$step.json" "$OUT/"
      done
      shift 4 ;;
    e2e)  # e2e BATCHES TEMPERATURES CONFIGS
      need_gguf; named_gguf  # method="auto" reads the cost file the tune stage wrote
      timeout $((570 - SECONDS)) python3 bench/e2e.py --model "$GGUF" --drafter "$(model_dir drafter)" \
        --adapter "$(model_dir adapter)" --eval-prompts "$(prompts)/eval_prompts.json" --batch $2 \
        --temperatures $3 --config $4 ${E2E_ARGS:-} \
        --json "$OUT/e2e_$(echo "$2_$3" | tr ' .' '-p')${E2E_LABEL:-}.json" 2>&1 | grep -v "^\[\|^W1\|^I1"
      shift 4 ;;
    agreement)  # agreement CONFIGS: bench/agreement.py, default mode and exact, differences explained
      need_gguf
      timeout $((570 - SECONDS)) python3 bench/agreement.py --model "$GGUF" --drafter "$(model_dir drafter)" \
        --adapter "$(model_dir adapter)" --eval-prompts "$(prompts)/eval_prompts.json" \
        --per-set ${AGREE_PER_SET:-8} --config $2 \
        --json "$OUT/agreement.json" 2>&1 | grep -v "^\[\|^W1\|^I1"
      shift 2 ;;
    tune)  # tune BATCHES TEMPERATURES: `weaver-jax tune` (method="auto"'s cost model) timed; the file into $OUT
      need_gguf; named_gguf
      # timed as a user runs it, without the persistent compilation cache (with it, 2026-12-05: 84 s; the same
      # programs without it on another host, bench/tune_split.py: 48 s - the cache's share not measured apart)
      t0=$SECONDS; env -u JAX_COMPILATION_CACHE_DIR $W tune --batch $2 --temperature $3 2>&1 | grep -v "^\[\|^W1\|^I1"
      echo "tune took $((SECONDS - t0)) s"; cp "$WEAVER_JAX_CACHE/auto_costs.json" "$OUT/"
      shift 3 ;;
    stream)  # bench/stream.py: what streaming costs against generate, the real pair (ar, weaver; 256 tokens)
      need_gguf; named_gguf
      timeout $((570 - SECONDS)) python3 bench/stream.py --methods ar weaver --rounds ${STREAM_ROUNDS:-0 1 4 16} --max-new-tokens 256 \
        --json "$OUT/stream.json" 2>&1 | grep -v "^\[\|^W1\|^I1\|Warning"
      shift ;;
    serve)  # serve METHODS: bench/serve_load.py, concurrency 1 / 4 / 16 / 64, 64 requests of 256 tokens; carry
      # .whl with starlette, uvicorn, openai and its needs (pydantic, pydantic_core, annotated-types,
      # typing-inspection, jiter, sniffio, httpx2, httpcore2, truststore): the GPU image lacks them
      need_gguf; named_gguf
      timeout $((570 - SECONDS)) python3 bench/serve_load.py --methods $2 --concurrency 1 4 16 64 --requests 64 \
        --max-tokens 256 --max-batch 16 ${SERVE_ARGS:-} \
        --json "$OUT/serve_$(echo "$2" | tr ' ' '-')${SERVE_LABEL:-}.json" 2>&1 | grep -v "^\[\|^W1\|^I1"
      shift 2 ;;
    profile)  # profile BATCH CONFIGS
      need_gguf
      timeout $((570 - SECONDS)) python3 bench/round_profile.py --model "$GGUF" --drafter "$(model_dir drafter)" \
        --adapter "$(model_dir adapter)" --batch "$2" --config $3 --json "$OUT/round_profile_b$2.json" 2>&1 | grep -v "^\[\|^W1\|^I1"
      shift 3 ;;
    probe)  # training step times at the SmolLM2 shape (random weights), to size the runs
      python3 bench/train_probe.py --steps 12 --drafter-batches 32 --adapter-batches 16 --json "$OUT/train_probe.json" \
        2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -4; shift ;;
    tree) python3 bench/tree_build.py --json "$OUT/tree_build.json"; shift ;;
    *) echo "unknown stage $1"; exit 2 ;;
  esac
done
send
