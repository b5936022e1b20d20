"""Autoregressive decode against the weight-streaming floor, measured in one run.

    python bench/decode.py --shape qwen3-8b --batch 1 --context 1024 --cache 2048 --json out.json
    python bench/decode.py --shape smollm2-135m --batch 1 8 32       # tokens/s at several batch sizes

Floor: one jitted call doing one matvec `x @ W` per weight matrix of the model (every weight
byte read once, as a decode step must), median over repeats. Decode step: the per-token time of
`ar_generate`'s while loop, as the difference between generating `n + 1` and `1` tokens after
the same prefill, divided by `n` (the prefill cancels). Random weights: speed does not depend on
their values (no EOS is used, every sequence runs to max_new_tokens).
"""

from __future__ import annotations

import argparse
import json
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

SHAPES = {"qwen3-8b": wj.qwen3_8b, "smollm2-135m": wj.smollm2_135m}


def timed(fn, repeats: int) -> list[float]:
    jax.block_until_ready(fn())  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def random_target(config: wj.ModelConfig) -> wj.Transformer:
    """Random weights made on the device, layer by layer (no host copy of 16 GB)."""
    abstract = nnx.eval_shape(lambda: wj.Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree.flatten(state)
    init = jax.jit(lambda k, shape, dtype: (jax.random.normal(k, shape, jnp.float32)
                                            / np.sqrt(shape[0] if len(shape) == 2 else 1)).astype(dtype),
                   static_argnums=(1, 2))
    made = [init(jax.random.key(i), leaf.shape, leaf.dtype) for i, leaf in enumerate(leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, made))


def weight_matrices(target: wj.Transformer) -> list[jax.Array]:
    mats = [target.embed[...] if target.lm_head is None else target.lm_head[...]]
    for layer in target.layers:
        mats += [layer.attn.qkv[...], layer.attn.out[...], layer.mlp.gate_up[...], layer.mlp.down[...]]
    return mats


def floor_seconds(target: wj.Transformer, batch: int, repeats: int) -> tuple[float, int]:
    mats = weight_matrices(target)
    dtype = mats[0].dtype

    @jax.jit
    def matvecs(ws, xs):
        outs = []
        for w, x in zip(ws, xs):
            if w.shape[0] == target.config.vocab_size:  # tied embedding [V, D]
                outs.append(jnp.einsum("bd,vd->bv", x, w))
            else:
                outs.append(x @ w)
        return outs

    xs = [jax.random.normal(jax.random.key(i), (batch, w.shape[1] if w.shape[0] == target.config.vocab_size
                                                 else w.shape[0]), jnp.float32).astype(dtype)
          for i, w in enumerate(mats)]
    nbytes = sum(w.size * w.dtype.itemsize for w in mats)
    return statistics.median(timed(lambda: matvecs(mats, xs), repeats)), nbytes


def decode_seconds(target, batch: int, context: int, cache_size: int, new_tokens: int, repeats: int):
    """Per-token decode time inside ar_generate's loop, prefill cancelled out."""
    config = target.config
    graphdef, params = nnx.split(target)
    prompts = jax.random.randint(jax.random.key(1), (batch, context), 0, config.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    keys = wj.sequence_keys(0, batch)

    def run(n):
        cache = wj.KVCache.init(config, batch, cache_size)
        out = wj.ar_generate(params, cache, prompts, lengths, keys, graphdef=graphdef, max_new_tokens=n)
        return out.tokens

    short = statistics.median(timed(lambda: run(1), repeats))
    long = statistics.median(timed(lambda: run(new_tokens + 1), repeats))
    return (long - short) / new_tokens, short


def step_seconds(target, batch: int, context: int, cache_size: int, repeats: int) -> float:
    """One jitted decode step (forward T=1 + argmax) called from Python, cache donated."""
    config = target.config
    graphdef, params = nnx.split(target)

    @jax.jit
    def step(params, cache, tokens):
        out = nnx.merge(graphdef, params)(tokens[:, None], cache.lengths[:, None], cache)
        return jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32), out.cache

    step = jax.jit(step, donate_argnums=1)
    cache = wj.KVCache.init(config, batch, cache_size).with_lengths(jnp.full((batch,), context))
    tokens = jnp.zeros((batch,), jnp.int32)
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
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    config = SHAPES[args.shape](dtype)
    t0 = time.perf_counter()
    target = random_target(config)
    print(f"# {args.shape} {dtype} on {jax.devices()[0].device_kind}; init {time.perf_counter() - t0:.1f}s", flush=True)
    rows = []
    for b in args.batch:
        floor, nbytes = floor_seconds(target, b, 20)
        decode, prefill = decode_seconds(target, b, args.context, args.cache, args.new_tokens, args.repeats)
        step = step_seconds(target, b, args.context, args.cache, 20)
        row = dict(shape=args.shape, dtype=dtype, batch=b, context=args.context, cache=args.cache,
                   weight_bytes=nbytes, floor_ms=floor * 1e3, floor_tb_s=nbytes / floor / 1e12,
                   decode_ms=decode * 1e3, decode_over_floor=decode / floor, step_call_ms=step * 1e3,
                   tokens_per_s=b / decode, prefill_plus_one_ms=prefill * 1e3, label=args.label,
                   device=jax.devices()[0].device_kind, jax=jax.__version__)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'shape':>13} {'B':>3} {'floor ms':>9} {'TB/s':>5} {'decode ms':>9} {'x floor':>7} "
          f"{'step ms':>8} {'tok/s':>9}")
    for r in rows:
        print(f"{r['shape']:>13} {r['batch']:>3} {r['floor_ms']:9.3f} {r['floor_tb_s']:5.2f} {r['decode_ms']:9.3f} "
              f"{r['decode_over_floor']:7.3f} {r['step_call_ms']:8.3f} {r['tokens_per_s']:9.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
