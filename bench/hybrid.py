"""Issue 20 on the H200: a Qwen3.6-27B-shaped hybrid target (random bfloat16 weights, 54 GB) - a decode
step against the weight-stream floor, verification of a tree against a step, and one GDN layer's tree
verification by the Pallas kernel against its XLA form.

    python bench/hybrid.py --json out.json [--layers 64] [--context 1024] [--nodes 65 129] [--batch 1]

Times are per iteration of a `fori_loop` with the carried value feeding the next iteration
(`decode._looped_seconds`: (time of n + 1 iterations - time of 1) / n, median of `--repeats`):
- `step`: one token through the target (`__call__`, then `commit`: the GDN states folded), the cache carried;
- `verify_N`: a random tree of N nodes (depth <= 15, as a drafter's block of 16 allows) through the target,
  its K/V written to scratch slots, the GDN states untouched (what a round's verification does);
- `floor_read` / `floor_matvec`: every weight matrix a step reads (LM head included, embedding not), streamed
  by a fused sum / multiplied by one row (`decode.floor_seconds`); `state_bytes`: the GDN states a step reads
  and writes (float32) and the K/V of the context;
- `gdn_xla_N` / `gdn_kernel_N`: one GDN layer's tree verification (`_gdn.gated_delta_tree` vs
  `pallas_kernels.tree_gdn`, `levels` = 15) at the layer's head shape, N nodes, the state carried.
`--layers` keeps Qwen's schedule (every fourth layer full attention) with fewer layers, for a quick run;
`--smoke` narrows the model (the GDN heads stay) for a check on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode as bench  # noqa: E402
from verify import random_tree  # noqa: E402

from weaver_jax import _gdn  # noqa: E402
from weaver_jax._hybrid import HybridTransformer, qwen3_6_27b  # noqa: E402
from weaver_jax.pallas_kernels import interpret  # noqa: E402
from weaver_jax.pallas_kernels.tree_gdn import tree_gdn  # noqa: E402

DEPTH = 15


def matrices(target: HybridTransformer) -> list[jax.Array]:
    """Every weight matrix a decode step reads: all 2-D parameters but the embedding (one row is read)."""
    return [p[...] for path, p in nnx.iter_graph(target)
            if isinstance(p, nnx.Param) and p.ndim == 2 and path[-1] != "embed"]


def forward_seconds(target, batch: int, context: int, nodes: int, repeats: int) -> float:
    """Per-iteration time of a forward over a random tree of `nodes` nodes (1: a decode step, then its
    commit) after a `context`-token prefill, the cache carried."""
    c = target.config
    graphdef, params = nnx.split(target)
    slots = context + nodes + 64
    prompts = jax.random.randint(jax.random.key(1), (batch, context), 0, c.vocab_size, jnp.int32)
    cache = jax.jit(lambda p: nnx.merge(graphdef, p).prefill(prompts, target.init_cache(batch, slots),
                                                             jnp.full((batch,), context)).cache)(params)
    tree = random_tree(batch, nodes, min(DEPTH, nodes - 1), c.vocab_size)
    attend = tree.ancestors()

    def body(carry, params):
        token, cache = carry
        model = nnx.merge(graphdef, params)
        out = model((tree.tokens + token[:, None]) % c.vocab_size, cache.lengths[:, None] + tree.depth, cache, attend)
        next_token = jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32)
        if nodes == 1:  # a decode step commits its token (then the lengths go back: the context stays fixed)
            committed = model.commit(out.cache, out.pending, jnp.zeros((batch, 1), jnp.int32),
                                     jnp.ones((batch,), jnp.int32))
            return next_token, committed.with_lengths(cache.lengths)
        return next_token, out.cache

    return bench._looped_seconds(body, (jnp.zeros((batch,), jnp.int32), cache), params, 16, repeats)


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
    ancestors = random_tree(batch, nodes, min(DEPTH, nodes - 1), 2).ancestors()
    state = jnp.zeros((batch, h_v, d_k, d_v), jnp.float32)
    inputs = (q, k, v, g, beta, ancestors)
    forms = {"xla": lambda s, x: _gdn.gated_delta_tree(*x[:5], s, x[5])[0],
             "kernel": lambda s, x: tree_gdn(*x[:5], s, x[5], levels=min(DEPTH, nodes - 1), interpret=interpret())[0]}
    return {f"gdn_{name}_{nodes}": bench._looped_seconds(
        lambda s, x, f=f: s + 1e-9 * f(s, x)[:, :1, :, None, :1].sum(1), state, inputs, 32, repeats)
        for name, f in forms.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--nodes", type=int, nargs="+", default=[65, 129])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-model", action="store_true", help="only the GDN layer timings")
    parser.add_argument("--smoke", action="store_true", help="a narrow model of the same schedule (a CPU check)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    t0 = time.time()
    narrow = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_heads=4, head_dim=64,
                  linear_num_value_heads=32) if args.smoke else {}
    config = qwen3_6_27b(layer_types=qwen3_6_27b().layer_types[: args.layers], **narrow)
    row = dict(shape="qwen3.6-27b", layers=args.layers, batch=args.batch, context=args.context,
               device=jax.devices()[0].device_kind)
    for n in args.nodes:
        row.update(gdn_seconds(config, args.batch, n, args.repeats))
        print(json.dumps(row), flush=True)
    if not args.skip_model:
        target = bench.random_module(lambda: HybridTransformer(config, rngs=nnx.Rngs(0)))
        mats = matrices(target)
        row.update(bench.floor_seconds(target, args.batch, args.repeats, mats))
        gdn_layers = config.layer_types.count("linear_attention")
        row["state_bytes"] = (2 * gdn_layers * args.batch * config.linear_num_value_heads * config.linear_key_head_dim
                              * config.linear_value_head_dim * 4
                              + 2 * (args.layers - gdn_layers) * args.batch * args.context * config.num_kv_heads
                              * config.head_dim * 2)
        row["step"] = forward_seconds(target, args.batch, args.context, 1, args.repeats)
        print(json.dumps(row), flush=True)
        for n in args.nodes:
            row[f"verify_{n}"] = forward_seconds(target, args.batch, args.context, n, args.repeats)
            row[f"verify_{n}_vs_step"] = row[f"verify_{n}"] / row["step"]
            print(json.dumps(row), flush=True)
        row["step_vs_floor_read"] = row["step"] / row["floor_read"]
    row["seconds"] = time.time() - t0
    print(json.dumps(row), flush=True)
    args.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
