"""Issue 20 on the H200: one Gated DeltaNet layer's tree verification at the Qwen3.6-27B shape (16 key /
48 value heads of 128), the Pallas kernel (`pallas_kernels.tree_gdn`, `levels` = 15: a 16-token drafter
block's deepest node) against its XLA form (`_gdn.gated_delta_tree`), per N nodes of a random tree.

    python bench/hybrid.py --json out.json [--nodes 17 65 129] [--batch 1 8]

Each is timed per iteration of a `fori_loop` whose carried state feeds the next iteration
(`decode._looped_seconds`). The rest of the shape's figures come from the dense targets' scripts, which take
the hybrid shape: `bench/decode.py --shape qwen3.6-27b` (a decode step against the weight-stream floor) and
`bench/verify.py --shape qwen3.6-27b` (verification against a step; the round stage by stage).
"""

from __future__ import annotations

import argparse
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
from weaver_jax.pallas_kernels import interpret  # noqa: E402
from weaver_jax.pallas_kernels.tree_gdn import tree_gdn  # noqa: E402

DEPTH = 15


def gdn_seconds(config, batch: int, nodes: int, repeats: int) -> dict:
    """One GDN layer's tree verification, XLA form against the kernel, the state carried."""
    h_k, h_v, d_k, d_v = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                          config.linear_value_head_dim)
    keys = jax.random.split(jax.random.key(2), 5)
    q = _gdn.l2_normalize(jax.random.normal(keys[0], (batch, nodes, h_k, d_k))) * d_k ** -0.5
    k = _gdn.l2_normalize(jax.random.normal(keys[1], (batch, nodes, h_k, d_k)))
    v = jax.random.normal(keys[2], (batch, nodes, h_v, d_v))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (batch, nodes, h_v)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, nodes, h_v)))
    levels = min(DEPTH, nodes - 1)
    ancestors = random_tree(batch, nodes, levels, 2).ancestors()
    state = jnp.zeros((batch, h_v, d_k, d_v), jnp.float32)
    inputs = (q, k, v, g, beta, ancestors)
    forms = {"xla": lambda s, x: _gdn.gated_delta_tree(*x[:5], s, x[5])[0],
             "kernel": lambda s, x: tree_gdn(*x[:5], s, x[5], levels=levels, interpret=interpret())[0]}
    return {f"{name}_us": 1e6 * bench._looped_seconds(  # the carry: the state nudged by the output
        lambda s, x, f=f: s + 1e-9 * f(s, x)[:, :1, :, None, :1].sum(1), state, inputs, 32, repeats)
        for name, f in forms.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--nodes", type=int, nargs="+", default=[17, 65, 129])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    config, rows = qwen3_6_27b(), []
    for batch in args.batch:
        for n in args.nodes:
            row = dict(shape="qwen3.6-27b", batch=batch, nodes=n, levels=min(DEPTH, n - 1),
                       **gdn_seconds(config, batch, n, args.repeats), device=jax.devices()[0].device_kind)
            row["kernel_vs_xla"] = row["xla_us"] / row["kernel_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
