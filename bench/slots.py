"""The server's loop without the server: `_stream.Slots` (continuous batching) against one `generate` call, the
same prompts, every row inserted at once and released at `--max-new-tokens`, no HTTP, no text.

    python bench/slots.py --batch 16 --contexts 1024 8192 --json out.json

A random target of SmolLM2's shape with the shipped drafter and adapter (`--random-target`, default; speed does
not depend on weight values with EOS off, but a random target accepts few draft tokens), or `--model`. Per method
and slots context: tokens/s, calls, the median call's milliseconds and the pacing's last rounds per call; the
second of two runs (the first compiles). What is left between this and `bench/serve_load.py` at the same
concurrency is the server's own cost (HTTP, text, requests arriving apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import round_profile  # noqa: E402

import weaver_jax as wj  # noqa: E402
from weaver_jax._stream import Slots  # noqa: E402


def through_slots(bundle, prompts, method: str, new: int, context: int) -> dict:
    slots = Slots(bundle, len(prompts), method=method, max_new_tokens=new, context=context)
    t0 = time.perf_counter()
    rows = list(range(len(prompts)))
    slots.insert(rows, rows, prompts, rows, 64)
    got, calls = dict.fromkeys(rows, 0), []
    while any(o is not None for o in slots.occupant):
        c0 = time.perf_counter()
        for row, tokens in slots.step():
            got[row] += len(tokens)
            if got[row] >= new:
                slots.release(slots.occupant.index(row))
        calls.append(time.perf_counter() - c0)
    seconds = time.perf_counter() - t0
    return dict(tokens_per_second=sum(min(n, new) for n in got.values()) / seconds, calls=len(calls),
                median_call_ms=statistics.median(calls) * 1e3, rounds_per_call=slots.loop.pace.rounds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--random-target", default="smollm2-135m")
    parser.add_argument("--methods", nargs="+", default=["ar", "weaver"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bundle = round_profile.bundle_for(argparse.Namespace(
        model=args.model, random_target=None if args.model else args.random_target, dtype=None, drafter=None,
        adapter=None, drafter_layers=0, adapter_shape={}))
    prompts = [list(range(1 + i, 60 + i)) for i in range(args.batch)]
    rows = []
    for method in args.methods:
        options = dict(method=method, max_new_tokens=args.max_new_tokens, eos_token_id=[])
        wj.generate(bundle, prompts, **options)  # compiled
        row = dict(method=method, batch=args.batch, max_new_tokens=args.max_new_tokens,
                   generate_tokens_per_second=wj.generate(bundle, prompts, **options).stats["tokens_per_second"],
                   target=args.model or f"random {args.random_target}", device=jax.devices()[0].device_kind)
        for context in args.contexts:
            through_slots(bundle, prompts, method, args.max_new_tokens, context)  # compiled
            slots = through_slots(bundle, prompts, method, args.max_new_tokens, context)
            row[f"context_{context}"] = slots | dict(
                vs_generate=slots["tokens_per_second"] / row["generate_tokens_per_second"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
