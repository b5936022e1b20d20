"""Tree attention: the Pallas kernel against the XLA reference and the K/V read floor (issue 8).

    python bench/tree_attention.py --json out.json
    python bench/tree_attention.py --prefix 4096 16384 --nodes 64 --batch 1 \
        --block-r 64 128 --block-k 64 128 --programs 264 1024 --warps 4 8 --stages 3   # a tuning sweep

Qwen3-8B shape (32 query / 8 K/V heads, head dim 128, bf16), one layer: prefix 1K / 4K / 16K, tree
nodes 16 / 64 / 256, batch 1 and 8. Each is timed inside a `fori_loop` with a loop-carried
dependency (bench/decode.py), `--layers` calls chained per iteration as a forward chains its layers,
twice, with the kernel's output checked against the reference first; `harness_ms` is the loop alone.
Floors: reading the prefix's K/V once at 3.7 TB/s (`floor_ms`), and the two products' FLOPs (4 B N H
prefix D) at the H200's measured 790 TFLOP/s for bf16 (`flop_floor_ms`): with G = 4 query heads per
K/V head the products do 4 N G FLOPs per K/V byte, so from N of about 16 the FLOP floor is the higher.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode as bench  # noqa: E402
from kernel_times import gpu_events  # noqa: E402

from weaver_jax.pallas_kernels.tree_attention import tree_attention, tree_attention_reference  # noqa: E402

TILES = ("block_r", "block_k", "programs", "splits", "num_warps", "num_stages", "partials_dtype")


def best_tiles(rows: list[dict]) -> dict:
    """The tile options with the highest mean speedup over XLA across the rows' configurations."""
    speedups = {}
    for row in rows:
        if "speedup" in row:
            speedups.setdefault(tuple(row.get(t) for t in TILES), []).append(row["speedup"])
    complete = {k: v for k, v in speedups.items() if len(v) == max(map(len, speedups.values()))}
    best = max(complete, key=lambda k: np.mean(complete[k]))
    return {name: value for name, value in zip(TILES, best, strict=True) if value is not None}


def v3_tiles(batch: int, kv_heads: int, rows: int) -> dict:
    """The third version's defaults, as explicit tiles (a same-run baseline): row blocks of 64, J + 1
    the largest power of two with at most 264 programs."""
    pairs = batch * kv_heads * -(-rows // 64)
    return dict(block_r=64, splits=max(2, 1 << (max(1, 264 // pairs).bit_length() - 1)) - 1)


def timed(fn, q, ws, steps: int, layers: int) -> list[float]:
    """ms per call of fn(q, ws), twice, inside a loop whose carry depends on the output: (time of
    steps + 1 iterations - time of 1) / steps / layers, median of 5. Each iteration chains `layers`
    calls, as a model's forward chains its layers: a GPU while loop waits for its predicate on the
    host every iteration (0.017-0.024 ms measured), which a model pays once per forward, not per layer."""
    def body(c, ws):
        for _ in range(layers):
            c = (c + 1e-3 * fn(c, ws).astype(c.dtype)).astype(c.dtype)
        return c
    return [bench._looped_seconds(body, q, ws, steps, 5) * 1e3 / layers for _ in range(2)]


def launch_us(fn, q, ws, calls: int = 20) -> dict:
    """GPU time per call of each launch of fn(q, ws) (kernel name -> microseconds), from a trace of `calls` calls."""
    run = jax.jit(fn)
    jax.block_until_ready(run(q, ws))
    totals = collections.defaultdict(float)
    for name, _op, us in gpu_events(lambda: [run(q, ws) for _ in range(calls)]):
        totals[name[:60]] += us / calls
    return dict(totals)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    # Tiles: each defaults to the kernel's own default
    parser.add_argument("--programs", type=int, nargs="+", default=[None],
                        help="programs the first kernel aims for (it picks the prefix splits)")
    parser.add_argument("--splits", type=int, nargs="+", default=[None], help="prefix splits J (overrides --programs)")
    parser.add_argument("--block-k", type=int, nargs="+", default=[None])
    parser.add_argument("--block-r", type=int, nargs="+", default=[None])
    parser.add_argument("--warps", type=int, nargs="+", default=[None])
    parser.add_argument("--stages", type=int, nargs="+", default=[None])
    parser.add_argument("--partials-dtype", nargs="+", default=[None], help="dtype of the partial outputs (o)")
    parser.add_argument("--v3", action="store_true", help="also time the third version's tiles (see v3_tiles)")
    parser.add_argument("--once", action="store_true",
                        help="run XLA and the kernel once each, untimed (for a profiler such as ncu)")
    parser.add_argument("--cache", type=int, default=0,
                        help="cache slots (default: the prefix and the tree, rounded up to 128)")
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], help="query heads, K/V heads, head dim")
    parser.add_argument("--steps", type=int, default=100, help="iterations per timed loop")
    parser.add_argument("--layers", type=int, default=8, help="calls chained per loop iteration")
    parser.add_argument("--profile", action="store_true",
                        help="also report each launch's GPU time per call (`launch_us`, from a profiler trace)")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pick", type=Path, help="print the best tiles of a sweep's JSON and exit")
    args = parser.parse_args()
    if args.pick:
        print(json.dumps(best_tiles(json.loads(args.pick.read_text()))))
        return
    h, kv, d = args.heads
    rows = []
    for b in args.batch:
        for prefix in args.prefix:
            for n in args.nodes:
                s = -(-max(prefix + n, args.cache) // 128) * 128
                keys = jax.random.split(jax.random.key(prefix + n + b), 3)
                q = jax.random.normal(keys[0], (b, n, h, d), jnp.bfloat16)
                k_cache = jax.random.normal(keys[1], (b, s, kv, d), jnp.bfloat16)
                v_cache = jax.random.normal(keys[2], (b, s, kv, d), jnp.bfloat16)
                lengths = jnp.full((b,), prefix, jnp.int32)
                ancestors = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
                ws = (k_cache, v_cache, lengths, ancestors)
                ref = tree_attention_reference(q, *ws)
                if args.once:
                    jax.block_until_ready(tree_attention(q, *ws, interpret=args.interpret))
                    continue
                xla = timed(lambda q, ws: tree_attention_reference(q, *ws), q, ws, args.steps, args.layers)
                harness = timed(lambda q, ws: q, q, ws, args.steps, args.layers)  # the loop and the chaining alone
                variants = [{name: value for name, value in zip(TILES, tiles, strict=True) if value is not None}
                            for tiles in itertools.product(args.block_r, args.block_k, args.programs, args.splits,
                                                           args.warps, args.stages, args.partials_dtype)]
                for options in variants + ([v3_tiles(b, kv, n * h // kv)] if args.v3 else []):
                    kernel = lambda q, ws, o=options: tree_attention(q, *ws, interpret=args.interpret, **o)  # noqa: E731
                    try:
                        error = float(jnp.abs(kernel(q, ws) - ref).max())
                        row = dict(kernel_ms=timed(kernel, q, ws, args.steps, args.layers), max_abs_error=error)
                        if args.profile:
                            row["launch_us"] = launch_us(kernel, q, ws)
                    except Exception as e:  # a configuration Triton rejects (e.g. out of shared memory)
                        row = dict(failed=f"{type(e).__name__}: {str(e)[:200]}")
                    row.update(batch=b, prefix=prefix, nodes=n, cache=s, **options, layers=args.layers, xla_ms=xla,
                               harness_ms=harness,
                               floor_ms=2 * b * prefix * kv * d * 2 / 3.7e12 * 1e3,
                               flop_floor_ms=4 * b * n * h * prefix * d / 790e12 * 1e3)
                    if "kernel_ms" in row:
                        row["speedup"] = float(np.mean(xla) / np.mean(row["kernel_ms"]))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
