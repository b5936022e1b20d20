"""Issue 20 on the H200: one Gated DeltaNet layer's tree verification at the Qwen3.6-27B shape (16 key /
48 value heads of 128), the Pallas kernel (`pallas_kernels.tree_gdn`, `block_v` value columns per program,
products at `precision`) against its XLA form (`_gdn.gated_delta_tree`) and exact mode's
(`_gdn.gated_delta_exact`), time and error (relative to the XLA form at "highest"), per N nodes of a random
tree of depth <= 15 (a 16-token drafter block's deepest node).

    python bench/hybrid.py --json out.json [--nodes 17 65 129] [--batch 1 8] [--block-v 32 64]
        [--precision tf32x3 tf32 ieee]
    python bench/hybrid.py --json out.json --profile [--nodes 17 65]   # GPU time per kernel of one call

Each is timed per iteration of a `fori_loop` whose carried state feeds the next iteration
(`decode._looped_seconds`). The rest of the shape's figures come from the dense targets' scripts, which take
the hybrid shape: `bench/decode.py --shape qwen3.6-27b` (a decode step against the weight-stream floor) and
`bench/verify.py --shape qwen3.6-27b` (verification against a step; the round stage by stage).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode as bench  # noqa: E402
from verify import random_tree  # noqa: E402

from weaver_jax import _gdn  # noqa: E402
from weaver_jax._hybrid import qwen3_6_27b  # noqa: E402
from weaver_jax._model import position_path  # noqa: E402
from weaver_jax.pallas_kernels import interpret  # noqa: E402
from weaver_jax.pallas_kernels.tree_gdn import PRECISIONS, tree_gdn  # noqa: E402

DEPTH = 15


def random_inputs(config, batch: int, nodes: int) -> tuple:
    """One GDN layer's tree inputs at `config`'s heads: (q, k, v, g, beta, state, ancestors) of a random
    tree of depth <= DEPTH, a random committed state."""
    h_k, h_v, d_k, d_v = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                          config.linear_value_head_dim)
    keys = jax.random.split(jax.random.key(2), 6)
    return (_gdn.l2_normalize(jax.random.normal(keys[0], (batch, nodes, h_k, d_k))) * d_k ** -0.5,
            _gdn.l2_normalize(jax.random.normal(keys[1], (batch, nodes, h_k, d_k))),
            jax.random.normal(keys[2], (batch, nodes, h_v, d_v)),
            -jax.nn.softplus(jax.random.normal(keys[3], (batch, nodes, h_v))),
            jax.nn.sigmoid(jax.random.normal(keys[4], (batch, nodes, h_v))),
            0.5 * jax.random.normal(keys[5], (batch, h_v, d_k, d_v)),
            random_tree(batch, nodes, min(DEPTH, nodes - 1), 2).ancestors())


def gdn_seconds(config, batch: int, nodes: int, block_vs: list[int], precisions: list[str], repeats: int) -> dict:
    """One GDN layer's tree verification, XLA form against the kernel, the state carried."""
    *heads, state, ancestors = random_inputs(config, batch, nodes)
    inputs = (*heads, ancestors)
    depth = ancestors.sum(-1, dtype=jnp.int32) - 1
    path = position_path(depth, jnp.zeros((batch,), jnp.int32), ancestors)
    forms = {"xla": lambda s, x: _gdn.gated_delta_tree(*x[:5], s, x[5])[0],
             # exact mode's: each node by the recurrence along its path (issue 42: its cost against the above)
             "exact": lambda s, x: _gdn.gated_delta_exact(*x[:5], s, path)[0],
             **{f"kernel_{p}_{bv}": lambda s, x, bv=bv, p=p: tree_gdn(*x[:5], s, x[5], block_v=bv, precision=p,
                                                                      interpret=interpret())[0]
                for bv in block_vs for p in precisions}}
    with jax.default_matmul_precision("highest"):
        want = forms["xla"](state, inputs)
    row = {}
    for name, f in forms.items():  # the carry: the state nudged by the output
        row[f"{name}_us"] = 1e6 * bench._looped_seconds(
            lambda s, x, f=f: s + 1e-9 * f(s, x)[:, :1, :, None, :1].sum(1), state, inputs, 32, repeats)
        # against the XLA form at "highest" (at JAX's default precision in scope, XLA's products are TF32)
        row[f"{name}_error"] = float(jnp.abs(f(state, inputs) - want).max() / jnp.abs(want).max())
    return row


def kernel_profile(config, nodes: int, precisions: list[str]) -> list[dict]:
    """GPU time per kernel of one tree-GDN call (B = 1) from a profiler trace, per product precision:
    how much of a call is the kernel and how much the XLA around it."""
    from kernel_times import gpu_events

    args = random_inputs(config, 1, nodes)
    rows = []
    for precision in precisions:
        run = functools.partial(tree_gdn, precision=precision, interpret=interpret())
        jax.block_until_ready(run(*args))
        for name, op, us in gpu_events(lambda run=run: [run(*args) for _ in range(4)][-1]):
            rows.append(dict(nodes=nodes, precision=precision, kernel=name, op=op, us=us / 4))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--nodes", type=int, nargs="+", default=[17, 65, 129])
    parser.add_argument("--block-v", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--precision", nargs="+", choices=sorted(PRECISIONS), default=["tf32x3"])
    parser.add_argument("--profile", action="store_true",
                        help="instead: GPU time per kernel of one call (B = 1) at each --nodes and --precision")
    args = parser.parse_args()
    config, rows = qwen3_6_27b(), []
    if args.profile:
        for n in args.nodes:
            rows += kernel_profile(config, n, args.precision)
        summary = collections.defaultdict(float)
        for r in rows:
            summary[r["nodes"], r["precision"], r["kernel"]] += r["us"]
        for key, us in summary.items():
            print(*key, f"{us:.1f} us", flush=True)
        args.json.write_text(json.dumps(rows, indent=1))
        return
    for batch in args.batch:
        for n in args.nodes:
            row = dict(shape="qwen3.6-27b", batch=batch, nodes=n, **gdn_seconds(config, batch, n, args.block_v,
                                                                             args.precision, args.repeats),
                       device=jax.devices()[0].device_kind)
            row["kernel_vs_xla"] = row["xla_us"] / min(v for key, v in row.items()
                                                       if key.startswith("kernel_") and key.endswith("_us"))
            rows.append(row)
            print(json.dumps(row), flush=True)
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
