#!/usr/bin/env bash
# A kernel against the GPU default in one device call (issue 39's attention_from_qkv): its tests compiled for the
# GPU, a step and a tree's verification at the SmolLM2 and 8B shapes (bench/verify.py, both selections in one
# process; SHAPES), and rounds through generate on a random SmolLM2-shape target with the shipped drafter and adapter
# (bench/round_profile.py, once per selection). Logs and JSON in $OUT.
#   bash bench/ab_kernels.sh attention_from_qkv
#   PARTS=verify NODES="16 32 64" FROM_QKV_MAX_NODES=1024 bash bench/ab_kernels.sh attention_from_qkv
#     (the fused form at larger trees too, `_model.FROM_QKV_MAX_NODES`: where its win turns into a loss)
set -uo pipefail
KERNEL=$1
OUT=${OUT:-ab-logs}
PARTS=${PARTS:-tests verify rounds}
NODES=${NODES:-1 64}
SHAPES=${SHAPES:-smollm2-135m qwen3-8b}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for sub in convert pallas_kernels; do [ -e weaver_jax/$sub ] || ln -s ../$sub weaver_jax/$sub; done
# a bench script run with the library's FROM_QKV_MAX_NODES overridden where set
RUN="import runpy, sys
from weaver_jax import _model
_model.FROM_QKV_MAX_NODES = int('${FROM_QKV_MAX_NODES:-0}') or _model.FROM_QKV_MAX_NODES
sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
# the GPU default without the kernel (both separators: verify.py's '+', WEAVER_JAX_KERNELS's ',')
without() {
  python3 -c "from weaver_jax.pallas_kernels import MEASURED; print('$1'.join(k for k in MEASURED if k != '$KERNEL'))"
}
if [[ " $PARTS " == *" tests "* ]]; then
  JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_pallas_tree_attention.py 2>&1 \
    | tail -4 | tee "$OUT/tests.txt"
fi
if [[ " $PARTS " == *" verify "* ]]; then
  for shape in $SHAPES; do
    timeout 170 python3 -c "$RUN" bench/verify.py --shape $shape --stages verify --nodes $NODES \
      --kernels "$(without +)" "$(without +)+$KERNEL" --json "$OUT/verify_$shape.json" 2>&1 | grep '^{' \
      | tee -a "$OUT/verify.txt"
  done
fi
if [[ " $PARTS " == *" rounds "* ]]; then
  for kernels in "$(without ,)" "$(without ,),$KERNEL"; do
    WEAVER_JAX_KERNELS=$kernels timeout 120 python3 -c "$RUN" bench/round_profile.py --random-target smollm2-135m \
      --wall-only --config ar weaver --max-new-tokens 128 --json "$OUT/rounds_${kernels##*,}.json" 2>&1 | grep '^{' \
      | tee -a "$OUT/rounds.txt"
  done
fi
