"""Which formulation of decode attention is fastest inside the loop (one process, same weights).

    python bench/decode_variants.py --json out.json --hlo-dir DIR

`einsum`: the model's `attend` (batched dot products). `reduce`: multiply-and-reduce, which XLA
emits as reduction kernels spread over the cache length instead of one small batched GEMM per head
group. Also writes the optimized HLO of the baseline loop, to count kernels per layer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode as bench  # noqa: E402

import weaver_jax as wj  # noqa: E402
from weaver_jax import _model  # noqa: E402

_einsum_attend = _model.gqa_attention


def reduce_attend(q, k, v, mask):
    scale = 1 / math.sqrt(q.shape[-1])
    scores = jnp.sum(q[:, :, None].astype(jnp.float32) * k[:, None, :, :, None].astype(jnp.float32), -1)
    scores = jnp.where(mask[:, :, :, None, None], scores * scale, _model._NEG_INF)  # [B, T, S, K, G]
    probs = jax.nn.softmax(scores, axis=2)
    return jnp.sum(probs[..., None] * v[:, None, :, :, None].astype(jnp.float32), axis=2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--hlo-dir", type=Path)
    args = parser.parse_args()
    config = bench.SHAPES[args.shape]("bfloat16" if jax.default_backend() != "cpu" else "float32")
    target = bench.random_target(config)
    context, cache = (1024, 2048) if args.shape == "qwen3-8b" else (64, 256)
    if args.hlo_dir:
        graphdef, params = nnx.split(target)
        c = wj.KVCache.init(config, args.batch, cache)
        p = jnp.zeros((args.batch, context), jnp.int32)
        lowered = wj.ar_generate.lower(params, c, p, jnp.full((args.batch,), context, jnp.int32),
                                       wj.sequence_keys(0, args.batch), graphdef=graphdef, max_new_tokens=8)
        text = lowered.compile().as_text()
        args.hlo_dir.mkdir(parents=True, exist_ok=True)
        (args.hlo_dir / "ar_generate.hlo.txt").write_text(text)
    floors = bench.floor_seconds(target, args.batch, 5)
    rows = []
    for name, fn in [("einsum", _einsum_attend), ("reduce", reduce_attend), ("einsum", _einsum_attend)]:
        _model.gqa_attention = fn
        decode, _ = bench.decode_seconds(target, args.batch, context, cache, 128, 5)
        rows.append(dict(variant=name, decode_ms=decode * 1e3, floor_matvec_ms=floors["floor_matvec"] * 1e3,
                         ratio=decode / floors["floor_matvec"]))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
