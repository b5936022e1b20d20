"""What streaming costs: tokens/s of `weaver_jax.stream` (chunks read as they come, wall time from the call)
against `generate` (one jitted loop: its wall time, and its stats' seconds, the loop alone), same prompt,
settings and tokens, at several `rounds_per_call`.

    python bench/stream.py --methods ar weaver --rounds 0 1 4 --max-new-tokens 128 --json out.json

The real SmolLM2 pair (or `--model`), EOS off, one chat prompt; everything compiled first; the median of
`--repeats` timed runs each; time to the first chunk too, beside the prefill's (generate with one new token).
A stream's tokens must equal generate's (checked).
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--random-target", help="a random target of this shape beside the shipped drafter and "
                        "adapter (round_profile.py's; no GGUF needed): the cost of streaming, not a speedup")
    parser.add_argument("--methods", nargs="+", default=["ar", "weaver"])
    parser.add_argument("--rounds", type=int, nargs="+", default=[0, 1, 4], help="rounds_per_call values; 0: the "
                        "default pacing (4 rounds first, then as many as take about a chunk's target seconds)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.random_target:
        bundle = round_profile.bundle_for(argparse.Namespace(
            random_target=args.random_target, dtype=None, drafter=None, adapter=None, drafter_layers=0,
            adapter_shape={}))
        prompt = list(range(1, 97))
    else:
        bundle = wj.load(args.model)
        message = {"role": "user", "content": "Write a short story about a lighthouse."}
        prompt = bundle.tokenizer.apply_chat_template([message])
    options = dict(max_new_tokens=args.max_new_tokens, eos_token_id=[])
    rows = []
    for method in args.methods:
        want = wj.generate(bundle, [prompt], method=method, **options)  # compiled here

        def timed_generate(method=method):  # -> (the call's wall time, its stats' seconds: the loop alone)
            t0 = time.perf_counter()
            seconds = wj.generate(bundle, [prompt], method=method, **options).stats["seconds"]
            return time.perf_counter() - t0, seconds

        def timed_stream(rounds, method=method, want=want):
            t0 = time.perf_counter()
            stream = wj.stream(bundle, prompt, method=method, rounds_per_call=rounds or None, **options)
            first = None
            for _ in stream:
                first = first or time.perf_counter() - t0
            assert stream.tokens == want.tokens[0], "a stream emitted other tokens than generate"
            return time.perf_counter() - t0, first

        runs = [timed_generate() for _ in range(args.repeats)]
        base_wall, base = (statistics.median(r[i] for r in runs) for i in (0, 1))
        wj.generate(bundle, [prompt], method=method, **(options | dict(max_new_tokens=1)))  # compiled here
        prefill = statistics.median(
            wj.generate(bundle, [prompt], method=method, **(options | dict(max_new_tokens=1))).stats["seconds"]
            for _ in range(args.repeats))
        for rounds in args.rounds:
            timed_stream(rounds)  # compiled here
            runs = [timed_stream(rounds) for _ in range(args.repeats)]
            seconds = statistics.median(r[0] for r in runs)
            rows.append(dict(method=method, rounds_per_call=rounds, generate_seconds=base, generate_wall=base_wall,
                             stream_seconds=seconds, stream_vs_generate=base / seconds,
                             stream_vs_generate_wall=base_wall / seconds,
                             first_chunk_ms=statistics.median(r[1] for r in runs) * 1e3, prefill_ms=prefill * 1e3,
                             tokens=len(want.tokens[0]),
                             device=jax.devices()[0].device_kind))
            print(json.dumps(rows[-1]), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
