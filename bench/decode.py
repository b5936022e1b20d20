"""Autoregressive decode against the weight-streaming floor, measured in one run.

    python bench/decode.py --shape qwen3-8b --batch 1 --context 1024 --cache 2048 --json out.json
    python bench/decode.py --shape smollm2-135m --batch 1 8 32       # tokens/s at several batch sizes
    python bench/decode.py --shape llama3.3-70b --mesh 1x4           # tensor parallel over 4 GPUs (issue 38)

Floor (the smaller of two, both per iteration of a loop, as decode runs): one matvec `x @ W` per
weight matrix of the model, and one fused sum over each weight matrix (pure streaming). Every
weight byte is read once, as a decode step must. Decode step: the per-token time of
`ar_generate`'s while loop, as the difference between generating `n + 1` and `1` tokens after
the same prefill, divided by `n` (the prefill cancels). Random weights: speed does not depend on
their values (no EOS is used, every sequence runs to max_new_tokens). With `--mesh DxM` the target is
drawn straight into its shards (`weaver_jax.shard`'s layout: no device ever holds it whole) and the floor is
one device's: its own shards streamed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import weaver_jax as wj  # noqa: E402
from weaver_jax import _generate, _sharding, cli  # noqa: E402
from weaver_jax._hybrid import qwen3_6_27b, qwen_layer_types  # noqa: E402
from weaver_jax.pallas_kernels import row_invariant  # noqa: E402

SHAPES = {"qwen3-8b": wj.qwen3_8b, "smollm2-135m": wj.smollm2_135m,
          # hybrid Gated DeltaNet targets: the real shape, and a narrow one of the same schedule (a CPU check)
          "qwen3.6-27b": qwen3_6_27b,
          "llama3.3-70b": lambda dtype: wj.ModelConfig(
              vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
              num_kv_heads=8, head_dim=128, rope_theta=500_000.0, rms_norm_eps=1e-5, tie_embeddings=False,
              max_seq_len=131072, dtype=dtype, family="llama", rope_scaling=wj.RopeScaling(8.0, 1.0, 4.0, 8192)),
          "hybrid-tiny": lambda dtype: qwen3_6_27b(dtype, vocab_size=1024, hidden_size=256, intermediate_size=512,
                                                   num_heads=4, head_dim=64, layer_types=qwen_layer_types(4))}


def timed(fn, repeats: int) -> list[float]:
    for _ in range(2):  # warm-up (and compile), twice: a second call that compiles again is not timed either
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def random_target(config: wj.ModelConfig | wj.HybridConfig, mesh=None) -> wj.Transformer | wj.HybridTransformer:
    kind = wj.HybridTransformer if isinstance(config, wj.HybridConfig) else wj.Transformer
    return random_module(lambda: kind(config, rngs=nnx.Rngs(0)), mesh)


def random_module(make, mesh=None):
    """Random weights made on the device, tensor by tensor (no host copy of 16 GB); on `mesh` (axes ("data",
    "model")) each drawn straight into its shards as `weaver_jax.shard` lays them out."""
    abstract = nnx.eval_shape(make)
    if mesh is not None:
        mesh = _sharding.auto_mesh(mesh)
        _sharding.group_fused(abstract, mesh.shape["model"])
    graphdef, state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(state)
    shardings = (_sharding.parameter_shardings(shapes, mesh) if mesh is not None
                 else jax.tree.map(lambda _: None, shapes))
    leaves, treedef = jax.tree.flatten(shapes)
    made = [_draw(leaf.shape, leaf.dtype, sharding)(jax.random.key(i)) for i, (leaf, sharding)
            in enumerate(zip(leaves, treedef.flatten_up_to(shardings), strict=True))]
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(treedef, made))
    return nnx.merge(graphdef, state)


@functools.cache
def _draw(shape: tuple[int, ...], dtype, sharding):
    """key -> a random tensor of this shape, dtype and sharding (compiled once per distinct one)."""
    return jax.jit(lambda key: (jax.random.normal(key, shape, jnp.float32)
                                / np.sqrt(shape[0] if len(shape) == 2 else 1)).astype(dtype), out_shardings=sharding)


def mesh_of(module):
    """The mesh `module`'s parameters lie on (`random_module(..., mesh)`), or None."""
    sharding = jax.tree.leaves(nnx.state(module))[0].sharding
    return sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None


def placed(target, x):
    """A cache or a per-sequence input `[B, ...]` on the target's mesh (as generate places them), or as it is."""
    return _generate._on_mesh(mesh_of(target), x)


def traced_on(target):
    """Where the target's programs trace: under its mesh (the Pallas kernels run per device there)."""
    mesh = mesh_of(target)
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def weight_matrices(target) -> list[jax.Array]:
    """Every weight matrix a decode step reads, the LM head first (the embedding when tied); the embedding
    otherwise is left out (a step reads one row of it)."""
    head = target.embed[...] if target.lm_head is None else target.lm_head[...]
    return [head] + [p[...] for path, p in nnx.iter_graph(target.layers) if isinstance(p, nnx.Param) and p.ndim == 2]


def _looped_seconds(body, init, weights, n: int, repeats: int, compiler_options: dict | None = None) -> float:
    """Per-iteration time of `body(carry, weights)` inside a fori_loop: (time(n + 1) - time(1)) / n.
    The weights are arguments, not constants captured by the trace."""
    run = jax.jit(lambda carry, ws, steps: jax.lax.fori_loop(0, steps, lambda _, c: body(c, ws), carry),
                  compiler_options=compiler_options)
    short = statistics.median(timed(lambda: run(init, weights, 1), repeats))
    long = statistics.median(timed(lambda: run(init, weights, n + 1), repeats))
    return (long - short) / n


def floor_seconds(target, batch: int, repeats: int) -> dict:
    """Two floors over the same weights, each inside a loop as decode is:
    `matvec`: one `x @ W` per weight matrix (the issue's definition; the LM head as in the model);
    `read`: one fused sum over each weight matrix (pure streaming, no matrix unit). On a mesh: the first device's
    shards (what each device streams per step)."""
    mats = [w.addressable_shards[0].data for w in weight_matrices(target)]  # one device's part (all of it unsharded)
    tied = target.lm_head is None
    d = target.config.hidden_size

    def matvecs(x, mats):
        total = jnp.zeros((x.shape[0], 1), jnp.float32)
        for i, w in enumerate(mats):
            if i == 0 and tied:
                y = jnp.einsum("bd,vd->bv", x, w)
            else:
                xi = jnp.resize(x, (x.shape[0], w.shape[0])) if w.shape[0] != d else x
                y = xi @ w
            total = total + y[:, :1].astype(jnp.float32)
        return x + (1e-6 * total).astype(x.dtype)  # a loop-carried dependency: nothing is hoisted

    def reads(acc, mats):
        scale = (1 + 1e-30 * acc).astype(mats[0].dtype)  # depends on the carry: nothing is hoisted
        return acc + sum(jnp.sum(w * scale, dtype=jnp.float32) for w in mats) * 1e-9

    x = jax.random.normal(jax.random.key(0), (batch, d), jnp.float32).astype(mats[0].dtype)
    nbytes = sum(w.size * w.dtype.itemsize for w in mats)
    return dict(weight_bytes=nbytes, floor_matvec=_looped_seconds(matvecs, x, mats, 32, repeats),
                floor_read=_looped_seconds(reads, jnp.float32(0), mats, 32, repeats))


def decode_seconds(target, batch: int, context: int, cache_size: int, new_tokens: int, repeats: int,
                   exact: bool = False):
    """Per-token decode time inside ar_generate's loop, prefill cancelled out (exact: `exact=True`'s)."""
    config = target.config
    graphdef, params = nnx.split(target)
    prompts = placed(target, jax.random.randint(jax.random.key(1), (batch, context), 0, config.vocab_size, jnp.int32))
    lengths = placed(target, jnp.full((batch,), context, jnp.int32))
    keys = placed(target, wj.sequence_keys(0, batch))

    def run(n):  # compiled as generate compiles it (exact mode's compiler options)
        args = (params, placed(target, target.init_cache(batch, cache_size)), prompts, lengths, keys)
        with traced_on(target):
            program = _generate._compiled(wj.ar_generate, dict(graphdef=graphdef, max_new_tokens=n, exact=exact),
                                          *args)
        return program(*args).tokens

    short = statistics.median(timed(lambda: run(1), repeats))
    long = statistics.median(timed(lambda: run(new_tokens + 1), repeats))
    return (long - short) / new_tokens, short


def looped_step_seconds(target, batch: int, context: int, cache_size: int, exact: bool, repeats: int) -> float:
    """One decode step (forward of one token per sequence, its commit, the argmax) inside a loop, from a cache
    at `context` (its contents do not change the time), no prefill: exact mode's step against the default one
    at a shape whose exact prefill (token by token through every GDN layer) is slow to time."""
    graphdef, params = nnx.split(target)
    cache = placed(target, target.init_cache(batch, cache_size).with_lengths(jnp.full((batch,), context)))

    def body(carry, params):
        tokens, cache = carry
        model = nnx.merge(graphdef, params)
        out = model(tokens[:, None], cache.lengths[:, None], cache, exact=exact)
        ones = jnp.ones((batch,), jnp.int32)
        cache = model.commit(out.cache, out.pending, jnp.zeros((batch, 1), jnp.int32), ones)
        return jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32), cache

    with traced_on(target):
        return _looped_seconds(body, (placed(target, jnp.zeros((batch,), jnp.int32)), cache), params, 16, repeats,
                               _generate.EXACT_COMPILER_OPTIONS if exact else None)


def kernels_per_step(target, batch: int, context: int, cache_size: int) -> int:
    """Kernels launched per decode step: fusions and custom calls in the compiled while-loop body."""
    graphdef, params = nnx.split(target)
    args = [placed(target, x) for x in (target.init_cache(batch, cache_size), jnp.zeros((batch, context), jnp.int32),
                                        jnp.full((batch,), context, jnp.int32), wj.sequence_keys(0, batch))]
    with traced_on(target):
        text = wj.ar_generate.lower(params, *args, graphdef=graphdef, max_new_tokens=2).compile().as_text()
    body = re.search(r" while\(.*?body=%([\w.\-]+)", text).group(1)
    computation = re.search(rf"^%{re.escape(body)} .*?^}}", text, re.M | re.S).group(0)
    return len(re.findall(r"= [^=]*\b(?:fusion|custom-call)\(", computation))


def step_seconds(target, batch: int, context: int, cache_size: int, repeats: int) -> float:
    """One jitted decode step (forward T=1 + argmax) called from Python, cache donated."""
    graphdef, params = nnx.split(target)

    @jax.jit
    def step(params, cache, tokens):
        out = nnx.merge(graphdef, params)(tokens[:, None], cache.lengths[:, None], cache)
        return jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32), out.cache

    step = jax.jit(step, donate_argnums=1)
    cache = placed(target, target.init_cache(batch, cache_size).with_lengths(jnp.full((batch,), context)))
    tokens = placed(target, jnp.zeros((batch,), jnp.int32))
    with traced_on(target):
        for _ in range(3):
            tokens, cache = step(params, cache, tokens)
    jax.block_until_ready(tokens)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens, cache = step(params, cache, tokens)
        jax.block_until_ready(tokens)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--dtype", default=None, help="parameter dtype (default bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--cache", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--exact", action="store_true", help="also time exact mode's decode step (issue 42: "
                        "against the default step of the same run)")
    parser.add_argument("--steps-only", action="store_true", help="only the looped decode step from a cache at "
                        "--context against the floor (no prefill: fewer compiles, for the largest shapes), and "
                        "with --exact exact mode's step per --tilings")
    parser.add_argument("--tilings", type=json.loads, nargs="+", default=[{}],
                        help="with --steps-only: exact mode's product launches to time, each JSON of "
                             "row_invariant.Tiling's fields over its default")
    parser.add_argument("--mesh", help="DxM: the target over a (data, model) mesh of D x M devices "
                        "(issue 38; the batch must divide over data)")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    config = SHAPES[args.shape](dtype)
    mesh = cli._mesh(args.mesh)
    if mesh is not None and any(b % mesh.shape["data"] for b in args.batch):
        parser.error(f"--batch {args.batch}: every batch size must divide over the mesh's data axis of "
                     f"{mesh.shape['data']}")
    t0 = time.perf_counter()
    target = random_target(config, mesh)
    print(f"# {args.shape} {dtype} on {jax.devices()[0].device_kind}{f', mesh {args.mesh}' if mesh else ''}; "
          f"init {time.perf_counter() - t0:.1f}s", flush=True)
    rows = []
    for b in args.batch:
        if args.steps_only:
            default = looped_step_seconds(target, b, args.context, args.cache, False, args.repeats)
            floors = floor_seconds(target, b, args.repeats)
            floor = min(floors["floor_matvec"], floors["floor_read"])
            rows.append(dict(shape=args.shape, dtype=dtype, batch=b, context=args.context, step_ms=default * 1e3,
                             floor_ms=floor * 1e3, step_over_floor=default / floor,
                             weight_bytes=floors["weight_bytes"], mesh=args.mesh, label=args.label,
                             device=jax.devices()[0].device_kind, jax=jax.__version__))
            print(json.dumps(rows[-1]), flush=True)
            for options in args.tilings if args.exact else []:
                row_invariant.TILING = tiling = row_invariant.Tiling()._replace(**options)
                exact = looped_step_seconds(target, b, args.context, args.cache, True, args.repeats)
                rows.append(dict(shape=args.shape, dtype=dtype, batch=b, context=args.context,
                                 step_ms=default * 1e3, exact_step_ms=exact * 1e3, exact_over_default=exact / default,
                                 tiling=tiling._asdict(), mesh=args.mesh, label=args.label,
                                 device=jax.devices()[0].device_kind,
                                 jax=jax.__version__))
                print(json.dumps(rows[-1]), flush=True)
                if args.json:
                    args.json.write_text(json.dumps(rows, indent=1))
            continue
        floors = floor_seconds(target, b, args.repeats)
        floor, nbytes = min(floors["floor_matvec"], floors["floor_read"]), floors["weight_bytes"]
        decode, prefill = decode_seconds(target, b, args.context, args.cache, args.new_tokens, args.repeats)
        step = step_seconds(target, b, args.context, args.cache, 20)
        kernels = kernels_per_step(target, b, args.context, args.cache)
        row = dict(shape=args.shape, dtype=dtype, batch=b, context=args.context, cache=args.cache,
                   weight_bytes=nbytes, floor_matvec_ms=floors["floor_matvec"] * 1e3,
                   floor_read_ms=floors["floor_read"] * 1e3, floor_ms=floor * 1e3, floor_tb_s=nbytes / floor / 1e12,
                   decode_ms=decode * 1e3, decode_over_floor=decode / floor, step_call_ms=step * 1e3,
                   tokens_per_s=b / decode, kernels_per_step=kernels, prefill_plus_one_ms=prefill * 1e3,
                   mesh=args.mesh, label=args.label,
                   device=jax.devices()[0].device_kind, jax=jax.__version__)
        rows.append(row)
        print(json.dumps(row), flush=True)  # before the exact step's timing, which can take minutes at 27B
        if args.exact:
            exact, _ = decode_seconds(target, b, args.context, args.cache, args.new_tokens, args.repeats, exact=True)
            row.update(exact_decode_ms=exact * 1e3, exact_over_default=exact / decode)
            print(json.dumps({"batch": b, "exact_decode_ms": row["exact_decode_ms"],
                              "exact_over_default": row["exact_over_default"]}), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    if args.steps_only:
        return
    print(f"{'shape':>13} {'B':>3} {'matvec ms':>9} {'read ms':>8} {'TB/s':>5} {'decode ms':>9} {'x floor':>7} "
          f"{'step ms':>8} {'tok/s':>9} {'kernels':>7}")
    for r in rows:
        print(f"{r['shape']:>13} {r['batch']:>3} {r['floor_matvec_ms']:9.3f} {r['floor_read_ms']:8.3f} "
              f"{r['floor_tb_s']:5.2f} {r['decode_ms']:9.3f} "
              f"{r['decode_over_floor']:7.3f} {r['step_call_ms']:8.3f} {r['tokens_per_s']:9.1f} "
              f"{r['kernels_per_step']:7d}")


if __name__ == "__main__":
    main()
