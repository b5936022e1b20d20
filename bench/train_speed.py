"""How long training a drafter and an adapter takes at a target's shape, random weights: training steps per second
of each (the recipe's batch: 32 sequences x 32 anchors, 512-token sequences) and the target's batched decoding
rate (the self-distilled data), with the recipe's duration projected from them (docs/own-model.md).

    python bench/train_speed.py --shape qwen3-8b --json out.json
    python bench/train_speed.py --shape smollm2-135m --steps 4 --batch 2 --anchors 4 --seq 64   # a CPU check

The recipe the shipped SmolLM2 pair came from (BENCHMARKS, issue 19): ~24,000 sequences of up to 256 prompt and 256
answer tokens decoded by the target at batch 512, 20,000 drafter steps, 20,000 adapter steps. Random weights: the
speed of a step does not depend on their values. The first logged steps (compiling) are left out of each rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode import SHAPES, decode_seconds, random_module, random_target  # noqa: E402

from weaver_jax import training  # noqa: E402
from weaver_jax._adapter import Adapter, AdapterConfig  # noqa: E402
from weaver_jax._drafter import Drafter, DrafterConfig  # noqa: E402

RECIPE = dict(sequences=24_000, answer_tokens=256, drafter_steps=20_000, adapter_steps=20_000)


def steps_per_second(run_dir: Path, warm: int) -> float:
    """Steps per second between the `warm`-th logged step and the last (the log's cumulative seconds)."""
    log = training.read_log(run_dir)
    first = next(r for r in log if r["step"] >= warm)
    return (log[-1]["step"] - first["step"]) / (log[-1]["seconds"] - first["seconds"])


def timed_fit(module, loss_fn, data, config, run_dir: Path, frozen: tuple, warm: int) -> float:
    training.fit(module, loss_fn, data, config, run_dir, frozen=frozen)
    return steps_per_second(run_dir, warm)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--dtype", default=None, help="parameter dtype (default bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--steps", type=int, default=24, help="steps per module, the first --warm not counted")
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512, help="tokens per training sequence (prompt and answer)")
    parser.add_argument("--drafter-layers", type=int, default=4)
    parser.add_argument("--decode-batch", type=int, default=64, help="batch of the data-generation rate")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    target = random_target(SHAPES[args.shape](dtype))
    c = target.config
    rng = np.random.default_rng(0)
    n = 4 * args.batch
    data = {"tokens": rng.integers(0, c.vocab_size, (n, args.seq)).astype(np.int32),
            "prompt_lengths": np.full((n,), args.seq // 4, np.int32), "lengths": np.full((n,), args.seq, np.int32),
            "source": np.zeros((n,), np.int32)}
    config = training.TrainConfig(steps=args.steps, batch_size=args.batch, anchors=args.anchors, log_every=1,
                                  save_every=10**9)
    drafter_config = DrafterConfig.like(c, num_layers=args.drafter_layers, num_features=3,
                                        mask_token_id=c.vocab_size - 1)
    adapter_config = AdapterConfig.like(c, d_rank=384, num_layers=2, num_heads=6, mlp_dim=1024, K=15)
    drafter = random_module(lambda: Drafter(drafter_config, rngs=nnx.Rngs(0)))
    adapter = random_module(lambda: Adapter(adapter_config, rngs=nnx.Rngs(1)))
    row = dict(shape=args.shape, dtype=dtype, batch=args.batch, anchors=args.anchors, seq=args.seq,
               drafter_layers=args.drafter_layers, device=jax.devices()[0].device_kind, jax=jax.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        row["drafter_steps_per_s"] = timed_fit(drafter, training.drafter_loss_fn(config), data, config,
                                               Path(tmp) / "drafter", (target,), args.warm)
        adapter_loss = training.adapter_loss_fn(config, adapter_config.candidate_pool_size)
        row["adapter_steps_per_s"] = timed_fit(adapter, adapter_loss, data, config, Path(tmp) / "adapter",
                                               (target, drafter), args.warm)
        row["fit_seconds"] = time.perf_counter() - t0
    step, _ = decode_seconds(target, args.decode_batch, args.seq // 2, args.seq, 16, 2)
    row["decode_batch"], row["decode_tokens_per_s"] = args.decode_batch, args.decode_batch / step
    hours = dict(data=RECIPE["sequences"] * RECIPE["answer_tokens"] / row["decode_tokens_per_s"] / 3600,
                 drafter=RECIPE["drafter_steps"] / row["drafter_steps_per_s"] / 3600,
                 adapter=RECIPE["adapter_steps"] / row["adapter_steps_per_s"] / 3600)
    row["recipe_hours"] = {k: round(v, 2) for k, v in hours.items()} | {"total": round(sum(hours.values()), 2)}
    print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps([row], indent=1))


if __name__ == "__main__":
    main()
