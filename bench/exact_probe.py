"""Issue 42: where exact mode stops being bitwise on a GPU. `make test-gpu` found a hybrid target's exact tree
logits differing from each path's own forward on an H100 (tests/test_exact.py; the dense family passes, and
every check passes on a CPU). This runs that comparison per layer kind, compiled (XLA fuses) and op by op
(`jax.disable_jit`: nothing fused, so no multiply-add contracted across ops), and says how many logits differ.

    python bench/exact_probe.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_exact import HYBRID_LAYERS, tree_and_prefill_logits  # noqa: E402

CASES = {"dense": ("qwen3", None), "hybrid": ("qwen3_5", HYBRID_LAYERS),
         "gdn_only": ("qwen3_5", ("linear_attention",)), "gated_attention_only": ("qwen3_5", ("full_attention",))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")  # as the suite
    rows = []
    for name in args.cases:
        for jit in (True, False):
            tree, alone = (np.asarray(x, np.float32) for x in tree_and_prefill_logits(*CASES[name], jit=jit)[True])
            differ = np.any(tree != alone, axis=1)  # [nodes]
            rows.append(dict(case=name, jit=jit, differ=int(np.sum(tree != alone)), of=int(tree.size),
                             max_abs=float(np.abs(tree - alone).max()),
                             first_node=int(np.argmax(differ)) if differ.any() else -1,
                             device=jax.devices()[0].device_kind))
            print(json.dumps(rows[-1]), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
