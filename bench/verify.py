"""Tree verification against a decode step, Weaver tree construction, and the per-round breakdown.

    python bench/verify.py --shape qwen3-8b --nodes 16 32 64 128 256 --json out.json
    python bench/verify.py --contexts 1024 16384 --kernels off on --stages verify --nodes 64

Every stage is timed inside a `fori_loop` with a loop-carried dependency, as (time(n + 1) -
time(1)) / n, like bench/decode.py: verification of an N-node random tree (ancestor mask,
positions len + depth) over a `--context`-token prefix, against N = 1 (a decode step) in the same
run (at each of `--contexts`, with the target's attention through XLA and/or the Pallas kernel,
`--kernels`); Weaver tree construction at budgets `--budgets` (adapter of width `--adapter-rank`,
`--adapter-layers` layers, `--pool` candidates per depth, 8 children per node) against the same number of
full-vocabulary projections done as one matmul; then one round's stages for `dflash`, `ddtree`
and `weaver` (`--round-budget`, 64): drafter proposal, tree build, verification, acceptance + commit.
Random weights; a 5-layer DFlash drafter of the target's width.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode as bench  # noqa: E402

import weaver_jax as wj  # noqa: E402
from weaver_jax import _model, _sharding  # noqa: E402
from weaver_jax._adapter import Adapter, AdapterConfig, weaver_tree  # noqa: E402
from weaver_jax._drafter import Drafter, DrafterConfig  # noqa: E402
from weaver_jax._speculative import DEFAULT_POOL, accept_and_move, build_tree, node_choices  # noqa: E402
from weaver_jax._tree import Tree  # noqa: E402
from weaver_jax.pallas_kernels import KERNELS, MEASURED, kernel_scope  # noqa: E402

TINY = wj.ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=True, family="qwen3")


def random_pair(config, *, drafter_layers: int = 5, drafter_features: int | None = None, block: int = 16,
                adapter_rank: int = 1024, adapter_layers: int = 2, adapter_heads: int | None = None,
                adapter_mlp: int | None = None, mesh=None) -> tuple[Drafter, Adapter]:
    """A random DFlash drafter of the target's width and a random Weaver adapter (the shapes this bench prices);
    on `mesh` the drafter drawn into its shards over `model`, the adapter whole on every device."""
    dconfig = DrafterConfig.like(config, num_layers=drafter_layers, num_features=drafter_features or drafter_layers,
                                 block_size=block, mask_token_id=config.vocab_size - 1, dtype=config.dtype)
    aconfig = AdapterConfig.like(config, d_rank=adapter_rank, num_layers=adapter_layers,
                                 num_heads=adapter_heads or max(1, adapter_rank // 128),
                                 mlp_dim=adapter_mlp or 4 * adapter_rank, K=block - 1, dtype=config.dtype)
    adapter = bench.random_module(lambda: Adapter(aconfig, rngs=nnx.Rngs(2)))
    return (bench.random_module(lambda: Drafter(dconfig, rngs=nnx.Rngs(1)), mesh),
            adapter if mesh is None else _sharding.shard_module(adapter, mesh, replicate=True, label="adapter"))


def random_tree(batch: int, n: int, depth: int, vocab: int, seed: int = 0) -> Tree:
    rng = np.random.default_rng(seed)
    parent, dep = [-1], [0]
    for i in range(1, n):
        p = int(rng.integers(0, i))
        while dep[p] >= depth:
            p = int(rng.integers(0, i))
        parent.append(p)
        dep.append(dep[p] + 1)
    tile = lambda a: jnp.broadcast_to(jnp.asarray(a, jnp.int32), (batch, n))  # noqa: E731
    return Tree(tile(rng.integers(0, vocab, n)), tile(parent), tile(dep), jnp.ones((batch, n), bool))


def dus_write(cache_layer, new, lengths):
    """The target's cache write before it became one scatter (a baseline): a vmapped dynamic_update_slice."""
    return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, (i, 0, 0)))(cache_layer, new, lengths)


CACHE_WRITES = {"scatter": _model._write, "dus": dus_write}


def verify_body(graphdef, tree: Tree, vocab: int, exact: bool = False):
    """One target forward of `tree` per iteration, `(token, cache)` carried: the tree's K/V are written
    into the cache in place, as generate's loop writes them. (A cache passed as a loop-invariant
    operand instead is copied whole before each layer's write: 1.2 ms a forward at 16K for Qwen3-8B.)
    exact: exact mode's row-invariant forward."""
    attend = tree.ancestors()

    def body(carry, params):
        token, cache = carry
        tokens = (tree.tokens + token[:, None]) % vocab
        out = nnx.merge(graphdef, params)(tokens, cache.lengths[:, None] + tree.depth, cache, attend,
                                          **({"exact": True} if exact else {}))
        return jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32), out.cache

    return body


def kernel_selection(spec: str) -> tuple[str, ...]:
    """'off', 'on', 'measured' or names joined by '+' (the first may be 'measured') -> kernel names."""
    named = {"off": (), "on": KERNELS, "measured": MEASURED}
    return tuple(dict.fromkeys(k for part in spec.split("+") for k in named.get(part, (part,))))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[*sorted(bench.SHAPES), "tiny"], default="qwen3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024])
    parser.add_argument("--kernels", nargs="+", default=["off"],
                        help="kernel selections, each in turn: off (XLA only), on (every kernel), measured (the GPU "
                             "default) or names joined by '+', e.g. measured+tree_gdn")
    parser.add_argument("--stages", choices=["verify", "tree", "round"], nargs="+", default=["verify", "tree", "round"])
    parser.add_argument("--methods", choices=["weaver", "dflash", "ddtree"], nargs="+",
                        default=["weaver", "dflash", "ddtree"], help="methods of the round stage")
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--drafter-layers", type=int, default=5)
    parser.add_argument("--drafter-features", type=int, help="target layers fused into the context (default: layers)")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--round-budget", type=int, default=64,
                        help="the round stage's tree budget (nodes = budget + 1; 63: 64 rows, a whole GEMM tile)")
    parser.add_argument("--calls", type=int, default=16,
                        help="Weaver expands ceil(budget / calls) nodes per adapter call, so a tree takes ~calls calls "
                             "(16 here, as issues 3-8 measured; generate's default is about 3)")
    parser.add_argument("--pool", type=int, default=DEFAULT_POOL,
                        help="Weaver's candidates per depth (generate's default; the adapter is made with 512)")
    parser.add_argument("--adapter-rank", type=int, default=1024)
    parser.add_argument("--adapter-layers", type=int, default=2)
    parser.add_argument("--adapter-heads", type=int, help="default: rank / 128")
    parser.add_argument("--adapter-mlp", type=int, help="default: 4 x rank")
    parser.add_argument("--round-compiler-options", type=json.loads, nargs="+", default=[{}],
                        help="XLA option sets (JSON) to compile the round's stages with, each in turn; the decode "
                             "step keeps XLA's defaults, e.g. '{}' '{\"xla_gpu_experimental_force_split_k\": 1}'")
    parser.add_argument("--cache-write", choices=sorted(CACHE_WRITES), nargs="+", default=["scatter"],
                        help="the target's cache write: the library's (scatter) and/or the earlier one (dus)")
    parser.add_argument("--kernel-options", type=json.loads, default={},
                        help='launch options per Pallas kernel, e.g. \'{"tree_attention": {"block_k": 128}}\'')
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    for name, options in args.kernel_options.items():  # callers look each kernel up in its module when traced
        module = importlib.import_module(f"weaver_jax.pallas_kernels.{name}")
        setattr(module, name, functools.partial(getattr(module, name), **options))
    config = TINY.replace(dtype=dtype) if args.shape == "tiny" else bench.SHAPES[args.shape](dtype)
    target = bench.random_target(config)
    drafter, adapter = random_pair(config, drafter_layers=args.drafter_layers, drafter_features=args.drafter_features,
                                   block=args.block, adapter_rank=args.adapter_rank, adapter_layers=args.adapter_layers,
                                   adapter_heads=args.adapter_heads, adapter_mlp=args.adapter_mlp)
    agraphdef, aparams = nnx.split(adapter)
    graphdef, params = nnx.split(target)
    dgraphdef, dparams = nnx.split(drafter)
    b, depth = args.batch, args.block - 1
    start = jnp.zeros((b,), jnp.int32)

    def loop(body, carry, ws, compiler_options=None):
        return bench._looped_seconds(body, carry, ws, 16, args.repeats, compiler_options)

    def caches(context):  # room for the longest tree past the prefix
        size = -(-(context + max(args.nodes + args.budgets) + 1) // 128) * 128
        return (target.init_cache(b, size).with_lengths(jnp.full((b,), context)),
                drafter.init_cache(b, size).with_lengths(jnp.full((b,), context)))

    def weaver_build(budget):
        def body(c, ws):
            a = nnx.merge(agraphdef, ws[0])
            return weaver_tree(a, ws[1], c, ws[2], ws[3], ws[4] * (1 + 1e-30 * c[:, None, None]), budget=budget,
                               children=8, expansions=-(-budget // args.calls),
                               pool_size=args.pool
                               ).tokens[:, -1]
        return body

    def propose(carry, ws):  # the drafter stage alone, for the breakdown
        t, d = nnx.merge(graphdef, ws[0]), nnx.merge(dgraphdef, ws[1])
        return d.propose(t, ws[2], carry, ws[3])[0]

    rows = []
    cache, dcache = caches(args.contexts[0])
    marginals, dstates = jax.jit(lambda ws: nnx.merge(dgraphdef, ws[1]).propose(
        nnx.merge(graphdef, ws[0]), ws[2], start, ws[3]))((params, dparams, cache, dcache))
    tables = jax.jit(lambda ws: nnx.merge(agraphdef, ws[0]).tables(nnx.merge(graphdef, ws[1])))((aparams, params))
    root_state = jax.random.normal(jax.random.key(3), (b, config.hidden_size), jnp.float32).astype(dtype)
    weaver_ws = (aparams, tables, root_state, dstates, marginals)
    trees = {"weaver": jax.jit(lambda ws: weaver_tree(nnx.merge(agraphdef, ws[0]), ws[1], start, ws[2], ws[3], ws[4],
                                                      budget=args.round_budget, children=8,
                                                      expansions=-(-args.round_budget // args.calls),
                                                      pool_size=args.pool))(weaver_ws),
             "dflash": build_tree("dflash", start, marginals, {}),
             "ddtree": build_tree("ddtree", start, marginals, {"budget": args.round_budget})}

    for context, write in itertools.product(args.contexts, args.cache_write):
        _model._write = CACHE_WRITES[write]  # looked up when the target's forward is traced
        cache, dcache = caches(context)
        for kernels in args.kernels:
            with kernel_scope(kernel_selection(kernels)):
                # plain decoding's step, compiled as ar_generate is (XLA's defaults)
                step = loop(verify_body(graphdef, random_tree(b, 1, 0, config.vocab_size), config.vocab_size),
                            (start, cache), params)
                for compiler_options in args.round_compiler_options:
                    stage = functools.partial(loop, compiler_options=compiler_options or None)

                    def verify_s(tree, cache=cache, stage=stage):
                        return stage(verify_body(graphdef, tree, config.vocab_size), (start, cache), params)

                    where = dict(context=context, kernels=kernels, compiler_options=compiler_options,
                                 cache_write=write, decode_step_ms=step * 1e3)
                    if "verify" in args.stages:
                        for n in args.nodes:
                            seconds = verify_s(random_tree(b, n, depth, config.vocab_size))
                            rows.append(dict(stage="verify", nodes=n, ms=seconds * 1e3, ratio=seconds / step, **where))
                            print(json.dumps(rows[-1]), flush=True)
                    if "round" not in args.stages:
                        continue
                    drafter_s = stage(lambda c, ws: jnp.argmax(propose(c, ws)[:, 0], -1).astype(jnp.int32), start,
                                      (params, dparams, cache, dcache))
                    for method in args.methods:
                        tree = trees[method]
                        if method == "weaver":
                            build_s = stage(weaver_build(args.round_budget), start, weaver_ws)
                        else:
                            options = {"budget": args.round_budget} if method == "ddtree" else {}
                            build_s = stage(lambda c, ws, m=method, o=options: build_tree(
                                m, c, ws * (1 + 1e-30 * c[:, None, None]), o).tokens[:, -1], start, marginals)
                        tree_verify_s = verify_s(tree)
                        logits = jax.random.normal(jax.random.key(0), (b, tree.size, config.vocab_size), jnp.float32)

                        def accept_commit(carry, ws, tree=tree):  # the Pallas kernels when --kernels on
                            logits = ws[0] + 1e-30 * carry[0][:, None, None]
                            acc, moved = accept_and_move(tree, logits, carry[1], ws[1], None, wj.Sampling(), depth)
                            return acc.bonus, moved

                        def walk_commit(carry, ws, tree=tree):  # the same without the per-node argmax over logits
                            choice = ws + (carry[0][:, None] % 2)
                            acc, moved = accept_and_move(tree, None, carry[1], None, None, wj.Sampling(), depth,
                                                         choice=choice)
                            return acc.bonus, moved

                        accept_s = stage(accept_commit, (start, cache), (logits, wj.sequence_keys(0, b)))
                        choices = node_choices(logits, wj.sequence_keys(0, b), None, wj.Sampling())
                        walk_s = stage(walk_commit, (start, cache), choices)
                        rows.append(dict(stage="round", method=method, nodes=tree.size, drafter_ms=drafter_s * 1e3,
                                         tree_ms=build_s * 1e3, verify_ms=tree_verify_s * 1e3,
                                         accept_commit_ms=accept_s * 1e3, walk_commit_ms=walk_s * 1e3, **where))
                        print(json.dumps(rows[-1]), flush=True)

    _model._write = CACHE_WRITES["scatter"]
    if "tree" in args.stages:
        head = target.embed[...] if target.lm_head is None else target.lm_head[...].T
        for budget in args.budgets:
            build = loop(weaver_build(budget), start, weaver_ws)
            xs = jax.random.normal(jax.random.key(4), (b * budget, config.hidden_size), jnp.float32).astype(dtype)
            full = loop(lambda c, ws: c + jnp.argmax((ws[0] * (1 + 1e-30 * c[0]).astype(ws[0].dtype)) @ ws[1].T,
                                                     -1)[: c.shape[0]].astype(jnp.int32), start, (xs, head))
            rows.append(dict(stage="weaver_tree", budget=budget, ms=build * 1e3, full_vocab_projections_ms=full * 1e3))
            print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r.update(shape=args.shape, batch=b, device=jax.devices()[0].device_kind)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
