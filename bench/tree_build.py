"""Where Weaver's tree-construction time goes, stage by stage (issue 4).

    python bench/tree_build.py --json out.json [--label cmdbuf]

Qwen3-8B shape (vocab 151936, width 4096), drafter depth K = 15, adapter of width 1024 and 2
layers, pool 512, 8 children per node. The target is not needed: the adapter's two tables and the
drafter's outputs are random arrays of their real shapes. Each stage is timed inside a `fori_loop`
with a loop-carried dependency (bench/decode.py): the pool top-k alone, DDTree's top-k alone, one
adapter prefix, one node-step call of w nodes, the batched best-first search with path-independent
scores (no adapter), and the whole Weaver tree for several budgets and expansions per call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode as bench  # noqa: E402

from weaver_jax._adapter import Adapter, AdapterConfig, Tables, WeaverState, adapter_children, weaver_tree  # noqa: E402
from weaver_jax._model import KVCache  # noqa: E402
from weaver_jax._tree import Tree, batched_best_first, marginal_children  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--adapter-rank", type=int, default=1024)
    parser.add_argument("--adapter-layers", type=int, default=2)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--expansions", type=int, nargs="+", default=[4, 8, 16], help="for budget 64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--label", default="default")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    b, k, v, d = args.batch, args.depth, args.vocab, args.width
    pool, children = min(512, v), 8
    aconfig = AdapterConfig(d_model=d, d_embed=d, d_rank=args.adapter_rank, num_layers=args.adapter_layers,
                            num_heads=max(1, args.adapter_rank // 128), mlp_dim=4 * args.adapter_rank, K=k,
                            candidate_pool_size=pool, dtype=dtype)
    adapter = bench.random_module(lambda: Adapter(aconfig, rngs=nnx.Rngs(2)))
    agraphdef, aparams = nnx.split(adapter)
    keys = jax.random.split(jax.random.key(0), 5)
    normal = lambda key, shape: (0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)  # noqa: E731
    tables = Tables(normal(keys[0], (v, args.adapter_rank)), normal(keys[1], (v, args.adapter_rank)))
    marginals = 3 * jax.random.normal(keys[2], (b, k, v), jnp.float32)
    dstates, root_state = normal(keys[3], (b, k, d)), normal(keys[4], (b, d))
    start = jnp.zeros((b,), jnp.int32)
    nudge = lambda x, c: x * (1 + 1e-30 * c.reshape((b,) + (1,) * (x.ndim - 1))).astype(x.dtype)  # noqa: E731
    loop = lambda body, ws: bench._looped_seconds(body, start, ws, 16, args.repeats) * 1e3  # noqa: E731
    rows = []

    def report(**row):
        rows.append(dict(row, label=args.label, batch=b, vocab=v, device=jax.devices()[0].device_kind))
        print(json.dumps(rows[-1]), flush=True)

    report(stage="pool_topk", ms=loop(lambda c, m: jax.lax.top_k(nudge(m, c), pool)[1][:, 0, 0], marginals))
    report(stage="ddtree_topk", ms=loop(lambda c, m: jax.lax.top_k(nudge(m, c), 64)[1][:, 0, 0], marginals))

    def prefix(c, ws):
        a = nnx.merge(agraphdef, ws[0])
        cache = a.prefix(nudge(ws[1], c), ws[2], KVCache.init(aconfig.block_config, b, k + 2 + 64))
        return c + (cache.k[-1][:, 0, 0, 0] > 0).astype(jnp.int32)
    report(stage="adapter_prefix", ms=loop(prefix, (aparams, root_state, dstates)))

    pool_logits, pool_ids = jax.jit(lambda m: jax.lax.top_k(m, pool))(marginals)
    cache = jax.jit(lambda ws: nnx.merge(agraphdef, ws[0]).prefix(
        ws[1], ws[2], KVCache.init(aconfig.block_config, b, k + 2 + 64)))((aparams, root_state, dstates))
    for w in args.expansions:
        tree = Tree(jnp.zeros((b, 65), jnp.int32), jnp.zeros((b, 65), jnp.int32).at[:, 0].set(-1),
                    jnp.minimum(jnp.arange(65), 1)[None].repeat(b, 0), jnp.ones((b, 65), bool))

        def node_step(c, ws, w=w, tree=tree):
            score = adapter_children(nnx.merge(agraphdef, ws[0]), ws[1], pool_ids, nudge(pool_logits, c), k + 1)
            state = WeaverState(ws[2], jnp.zeros((b, 65, 65), bool))
            return score(state, tree, jnp.broadcast_to(1 + jnp.arange(w), (b, w)), children)[0][:, 0, 0]
        report(stage="node_step", expansions=w, ms=loop(node_step, (aparams, tables, cache)))

        def marginal_search(c, m, w=w):
            score = marginal_children(nudge(m, c), children)
            tree, _ = batched_best_first(c, score, None, budget=64, children=children, expansions=w, max_depth=k)
            return tree.tokens[:, -1]
        report(stage="marginal_search", budget=64, expansions=w, ms=loop(marginal_search, marginals))

    def weaver(budget, w):
        def body(c, ws):
            return weaver_tree(nnx.merge(agraphdef, ws[0]), ws[1], c, ws[2], ws[3], nudge(ws[4], c), budget=budget,
                               children=children, expansions=w, pool_size=pool).tokens[:, -1]
        return loop(body, (aparams, tables, root_state, dstates, marginals))

    for budget in args.budgets:
        report(stage="weaver_tree", budget=budget, expansions=-(-budget // 16), ms=weaver(budget, -(-budget // 16)))
    for w in args.expansions:
        if w != 4:
            report(stage="weaver_tree", budget=64, expansions=w, ms=weaver(64, w))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
