"""Tree attention: the Pallas kernel against the XLA reference and the K/V read floor (issue 8).

    python bench/tree_attention.py --json out.json

Qwen3-8B shape (32 query / 8 K/V heads, head dim 128, bf16), one layer: prefix 1K / 4K / 16K, tree
nodes 16 / 64 / 256, batch 1 and 8. Each is timed inside a `fori_loop` with a loop-carried
dependency (bench/decode.py), twice, with the kernel's output checked against the reference first.
Floor: reading the prefix's K/V once at 3.7 TB/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode as bench  # noqa: E402

from weaver_jax.pallas_kernels.tree_attention import tree_attention, tree_attention_reference  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], help="query heads, K/V heads, head dim")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    h, kv, d = args.heads
    rows = []
    for b in args.batch:
        for prefix in args.prefix:
            for n in args.nodes:
                s = -(-(prefix + n) // 128) * 128
                keys = jax.random.split(jax.random.key(prefix + n + b), 3)
                q = jax.random.normal(keys[0], (b, n, h, d), jnp.bfloat16)
                k_cache = jax.random.normal(keys[1], (b, s, kv, d), jnp.bfloat16)
                v_cache = jax.random.normal(keys[2], (b, s, kv, d), jnp.bfloat16)
                lengths = jnp.full((b,), prefix, jnp.int32)
                ancestors = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
                kernel = lambda q, ws: tree_attention(q, *ws, block_k=args.block_k, chunk=args.chunk,  # noqa: E731
                                                      interpret=args.interpret)
                error = float(jnp.abs(kernel(q, (k_cache, v_cache, lengths, ancestors))
                                      - tree_attention_reference(q, k_cache, v_cache, lengths, ancestors)).max())
                row = dict(batch=b, prefix=prefix, nodes=n, max_abs_error=error,
                           floor_ms=2 * b * prefix * kv * d * 2 / 3.7e12 * 1e3)
                for name, fn in (("kernel", kernel), ("xla", lambda q, ws: tree_attention_reference(q, *ws))):
                    body = lambda c, ws, fn=fn: (c + 1e-3 * fn(c, ws).astype(c.dtype)).astype(c.dtype)  # noqa: E731
                    row[f"{name}_ms"] = [bench._looped_seconds(body, q, (k_cache, v_cache, lengths, ancestors), 8, 3)
                                         * 1e3 for _ in range(2)]
                row["speedup"] = float(np.mean(row["xla_ms"]) / np.mean(row["kernel_ms"]))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
