"""What sharding costs on one device: tokens/s through `generate` of the unsharded bundle, the same bundle
`weaver_jax.shard`ed over a 1 x 1 mesh, and the unsharded bundle with the cache write of before (a scatter
indexed by batch row, instead of the batch as a batching dimension), all in one run.

    python bench/sharding.py --json out.json

The target is random at SmolLM2-135M's shape (bfloat16) with the shipped drafter and adapter: a round costs what
the real pair's costs, but τ is ~1 (the drafter was not trained for this target), so the ratios compare rounds,
not speedups. Prompts: random ids, 96 tokens; 128 new tokens, EOS off; the median of 3 timed calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import weaver_jax as wj  # noqa: E402
from weaver_jax import _drafter, _generate, _hybrid, _model, _speculative  # noqa: E402
from weaver_jax._load import SHIPPED_WEIGHTS, Bundle, _load_part  # noqa: E402
from weaver_jax.testing import random_target  # noqa: E402


def indexed_write(cache_layer, new, lengths):
    """The cache write before sharding: one scatter indexed by (row, slot)."""
    b, t = new.shape[:2]
    slots = lengths[:, None] + jnp.arange(t)
    return cache_layer.at[jnp.arange(b)[:, None], slots].set(new, mode="drop", indices_are_sorted=True,
                                                             unique_indices=True)


def use_write(write):
    for module in (_model, _drafter, _hybrid, _speculative):
        module._write = write
    _generate._COMPILED.clear()
    jax.clear_caches()


def tokens_per_second(bundle, prompts, method, batch, new_tokens):
    rates = []
    for _ in range(4):  # the first compiles
        out = wj.generate(bundle, prompts[:batch], method=method, max_new_tokens=new_tokens, eos_token_id=[])
        rates.append(out.stats["tokens_per_second"])
    return statistics.median(rates[1:]), out.tokens


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--methods", nargs="+", default=["ar", "weaver"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args()
    config = wj.smollm2_135m("bfloat16")
    weights = SHIPPED_WEIGHTS / "smollm2-135m-instruct"
    bundle = Bundle(random_target(config, 0), drafter=_load_part(weights / "drafter", "drafter", "bfloat16", config),
                    adapter=_load_part(weights / "adapter", "adapter", "bfloat16", config))
    sharded = wj.shard(bundle, jax.make_mesh((1, 1), ("data", "model")))
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (max(args.batch), 96)).tolist()
    rows = []
    for method in args.methods:
        for batch in args.batch:
            new_write, tokens = tokens_per_second(bundle, prompts, method, batch, args.max_new_tokens)
            mesh_rate, mesh_tokens = tokens_per_second(sharded, prompts, method, batch, args.max_new_tokens)
            use_write(indexed_write)
            old_write, old_tokens = tokens_per_second(bundle, prompts, method, batch, args.max_new_tokens)
            use_write(NEW_WRITE)
            row = dict(method=method, batch=batch, unsharded=new_write, mesh_1x1=mesh_rate, indexed_write=old_write,
                       mesh_vs_unsharded=mesh_rate / new_write, batched_vs_indexed_write=new_write / old_write,
                       same_tokens=tokens == mesh_tokens == old_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=str(jax.devices()[0]), rows=rows), indent=1))


NEW_WRITE = _model._write

if __name__ == "__main__":
    main()
