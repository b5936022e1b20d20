"""Issue 42: where exact mode stops being bitwise on a GPU. `make test-gpu` found a hybrid target's exact tree
logits differing from each path's own forward on an H100 (tests/test_exact.py; the dense family passes, every
check passes on a CPU, and storing products before adds - no FMA contraction - did not change it). This runs
that comparison per layer kind and size, compiled and op by op (`jax.disable_jit`: nothing fused), records
every projection, norm, rope, attention, recurrence and layer output on the way (patched in), and says which
of them differs first between a tree node and the same token in its path's own forward (and the prompt's
prefill against the same tokens there).

    python bench/exact_probe.py --json out.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

import jax
import numpy as np

from weaver_jax import _gdn, _hybrid, _model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_exact import HYBRID_LAYERS, tree_and_prefill_logits  # noqa: E402

CASES = {"dense": ("qwen3", None, {}), "hybrid": ("qwen3_5", HYBRID_LAYERS, {}),
         "gdn_only": ("qwen3_5", ("linear_attention",), {}),
         "gated_attention_only": ("qwen3_5", ("full_attention",), {}),
         "gated_attention_only_wide": ("qwen3_5", ("full_attention",), {"hidden_size": 64}),
         "dense_narrow": ("qwen3", None, {"hidden_size": 32, "intermediate_size": 48})}
RECORDED = [(_hybrid, "dense"), (_hybrid, "zero_centered_rms_norm"), (_hybrid, "partial_rope"),
            (_hybrid, "per_head_kernel"), (_model, "dense"), (_model, "rms_norm"), (_model, "apply_rope"),
            (_model, "per_head_kernel"), (_gdn, "dense"), (_gdn, "l2_normalize"), (_gdn, "conv_tree"),
            (_gdn, "gated_delta_exact"), (_gdn, "gated_delta_sequential")]


def record(recorder, name, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        recorder.append((name, out[0] if isinstance(out, tuple) else out))
        return out
    return wrapped


def by_occurrence(part):
    seen = collections.Counter()
    keyed = {}
    for name, value in part:
        keyed[name, seen[name]] = value
        seen[name] += 1
    return keyed


def compare(prefill, tree, alone, rows):
    """Per recorded value, in the tree's order: how many of the 12 nodes differ from the alone forward, and
    for values the prefill also computes, how many of the prompt's tokens differ from the alone forward's."""
    prefill, alone = by_occurrence(prefill), by_occurrence(alone)
    out = []
    for (name, i), value in by_occurrence(tree).items():
        t, a = np.asarray(value, np.float32), np.asarray(alone[name, i], np.float32)
        nodes = np.stack([a[n, r] for n, r in enumerate(rows)])  # the alone forward at each node's row
        entry = dict(name=f"{name}#{i}", nodes_differ=int(np.sum(np.any((t[0] != nodes).reshape(len(rows), -1), 1))),
                     max_abs=float(np.abs(t[0] - nodes).max()))
        if (name, i) in prefill:
            p = np.asarray(prefill[name, i], np.float32)[0]
            prompt = a[0, : p.shape[0]]
            entry["prompt_differ"] = int(np.sum(np.any((p != prompt).reshape(p.shape[0], -1), 1)))
        out.append(entry)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")  # as the suite
    recorder = []
    for module, name in RECORDED:
        setattr(module, name, record(recorder, name, getattr(module, name)))
    layer = _hybrid.HybridLayer.finish
    _hybrid.HybridLayer.finish = lambda self, x, mixed, exact=False: record(recorder, "layer", layer)(
        self, x, record(recorder, "mixer", lambda m: m)(mixed), exact)
    rows = []
    for name in args.cases:
        family, layer_types, sizes = CASES[name]
        for jit in (True, False):
            try:
                result = tree_and_prefill_logits(family, layer_types, jit=jit, exact_only=True, recorder=recorder,
                                                 **sizes)
            except Exception as e:  # noqa: BLE001 - one case's failure is a finding, not the end of the probe
                rows.append(dict(case=name, jit=jit, error=f"{type(e).__name__}: {str(e)[:300]}"))
            else:
                tree, alone, *parts = result[True]
                names = iter(name for name, _ in recorder)
                parts = [[(next(names), value) for value in part] for part in parts]
                tree, alone = np.asarray(tree, np.float32), np.asarray(alone, np.float32)
                steps = compare(*parts, result["rows"])
                rows.append(dict(case=name, jit=jit, differ=int(np.sum(tree != alone)), of=int(tree.size),
                                 max_abs=float(np.abs(tree - alone).max()),
                                 first=next((s for s in steps if s["nodes_differ"] or s.get("prompt_differ")), None),
                                 steps=steps, device=jax.devices()[0].device_kind))
            recorder.clear()
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "steps"}), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
