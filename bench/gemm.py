"""Products at the row counts a round uses, against each weight's streaming floor (issue 39).

    python bench/gemm.py --shape qwen3-8b --rows 1 16 64 65 80 --json out.json

A decode step multiplies one row by every weight, verification 16-129 rows (the tree's nodes), the
drafter 15. At these M a product is bound by reading the weight once (an 8B shape's `gate_up` is
201 MB: 54 us at 3.7 TB/s; the FLOPs of 65 rows take ~1/10 of that on the tensor cores), so the
figure of merit is time / floor, the floor being one fused sum over the same matrix (`read`). For each
weight matrix of one layer of `--shape` (and the LM head), for each M: XLA's product (what `dense`
runs), exact mode's row-invariant product at each of `--tilings` (issue 42: its launch per weight shape),
and with `--small-m` the `small_m` Pallas kernel (bench/small_m.py, a candidate) with each `--block-n` and
`--split-k`, all inside a `fori_loop` with a loop-carried dependency, as (time(n + 1) - time(1)) / n
(bench/decode.py).

    python bench/gemm.py --shape qwen3.6-27b --rows 1 16 --tilings '{}' '{"block_k": 128}' '{"stages": 4}'

`--mgpu CONFIG ...` also times JAX's own Hopper product on Pallas' Mosaic GPU backend (TMA loads, wgmma,
warp-specialised pipeline: `jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`, a candidate for verification's
64 rows), each JSON CONFIG the fields of its `TuningConfig` (rows must divide by its tile_m):

    python bench/gemm.py --rows 64 128 --mgpu '{"tile_m": 64, "tile_n": 64, "tile_k": 64, "max_concurrent_steps": 6}'
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode as bench  # noqa: E402
from small_m import matmul as small_m  # noqa: E402

from weaver_jax.pallas_kernels import interpret  # noqa: E402
from weaver_jax.pallas_kernels.row_invariant import TILING  # noqa: E402
from weaver_jax.pallas_kernels.row_invariant import matmul as row_invariant  # noqa: E402


def layer_weights(config) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of each product a layer of this shape runs (fused as the model fuses them)."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv": (d, q + 2 * kv), "o": (q, d), "gate_up": (d, 2 * f), "down": (f, d),
            "lm_head": (d, config.vocab_size)}


def mgpu_product(options: dict):
    """x @ w through `hopper_matmul_mgpu.matmul` at a TuningConfig made of `options` (its wg_dimension and
    grid_minor_dim by name: "M" or "N")."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as mgpu

    fields = {k: mgpu.MatmulDimension[v] if k in ("wg_dimension", "grid_minor_dim", "cluster_dimension") and v
              else v for k, v in options.items()}
    config = mgpu.TuningConfig(**fields)
    return lambda x, w: mgpu.matmul(x, w, None, config)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(bench.SHAPES), default="qwen3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 48, 63, 64, 65, 80, 96, 128])
    parser.add_argument("--weights", nargs="+", help="default: every product of a layer and the LM head")
    parser.add_argument("--tilings", type=json.loads, nargs="*", default=[{}],
                        help="row-invariant product launches (JSON: fields of row_invariant.Tiling over its default)")
    parser.add_argument("--small-m", action="store_true", help="also time bench/small_m.py's kernel")
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--split-k", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--block-k", type=int, default=128)
    parser.add_argument("--num-stages", type=int, default=4)
    parser.add_argument("--mgpu", type=json.loads, nargs="*", default=[],
                        help="JAX's Hopper Mosaic GPU product at these TuningConfig fields (JSON each)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = bench.SHAPES[args.shape]("bfloat16")
    rows = []
    for name, (k, n) in layer_weights(config).items():
        if args.weights and name not in args.weights:
            continue
        w = (jax.random.normal(jax.random.key(0), (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
        read = bench._looped_seconds(
            lambda acc, w: acc + jnp.sum(w * (1 + 1e-30 * acc).astype(w.dtype), dtype=jnp.float32) * 1e-9,
            jnp.float32(0), w, 32, args.repeats)
        for m in args.rows:
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
            variants = {"xla": lambda x, w: x @ w}
            for options in args.tilings:
                tiling = TILING._replace(**options)
                variants["row_invariant/" + "/".join(map(str, tiling))] = functools.partial(
                    row_invariant, tiling=tiling, interpret=interpret())
            for bn, sk in itertools.product(args.block_n, args.split_k) if args.small_m else ():
                if n % bn or k % (sk * args.block_k):
                    continue
                variants[f"small_m/{bn}/{sk}"] = functools.partial(
                    small_m, block_n=bn, split_k=sk, block_k=args.block_k, num_stages=args.num_stages,
                    interpret=interpret())
            for options in args.mgpu:
                if m % options["tile_m"] == 0:
                    variants["mgpu/" + "/".join(f"{v}" for v in options.values())] = mgpu_product(options)
            row = dict(weight=name, k=k, n=n, rows=m, read_us=read * 1e6, bytes=k * n * 2)
            want = (x @ w).astype(jnp.float32)  # what each candidate's product is compared with
            for label, product in variants.items():
                def body(x, w, product=product):
                    y = product(x, w)
                    return x + (1e-6 * y[:, :1]).astype(x.dtype)
                try:
                    seconds = bench._looped_seconds(body, x, w, 32, args.repeats)
                except Exception as e:  # a candidate's config that does not fit (shared memory, tiles)
                    row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    continue
                if label != "xla":
                    row[f"{label}_max_abs_diff"] = float(jnp.abs(product(x, w).astype(jnp.float32) - want).max())
                row[f"{label}_us"] = seconds * 1e6
                row[f"{label}_over_read"] = seconds / read
            print(json.dumps(row), flush=True)
            rows.append(row)
    for r in rows:
        r.update(shape=args.shape, device=jax.devices()[0].device_kind)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
