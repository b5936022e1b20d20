"""Tokens/s of the real SmolLM2-135M-Instruct through `weaver_jax.generate` at several batch sizes.

    python bench/smollm2_generate.py --batch 1 8 32 --max-new-tokens 64 --json out.json

EOS is disabled so every sequence emits exactly max_new_tokens; tokens/s counts the jitted call
(prefill included, compilation excluded), as `generate`'s stats do.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import jax

import weaver_jax

# Made-up requests (not from any evaluation set): only their lengths matter here.
REQUESTS = [
    "Write a haiku about autumn leaves.", "Give me three tips for learning to cook.",
    "Explain what a hash table is.", "Summarise the plot of a heist movie you invent.",
    "List five uses for a paperclip.", "Describe the water cycle for a child.",
    "What makes a good password?", "Draft a polite email declining a meeting.",
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bundle = weaver_jax.load("smollm2-135m-instruct")
    tok = bundle.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": r}]) for r in REQUESTS]
    rows = []
    for b in args.batch:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        runs = [weaver_jax.generate(bundle, batch, max_new_tokens=args.max_new_tokens, eos_token_id=[]).stats
                for _ in range(args.repeats)]
        tps = statistics.median(r["tokens_per_second"] for r in runs)
        rows.append(dict(batch=b, tokens_per_s=tps, max_new_tokens=args.max_new_tokens, dtype=bundle.config.dtype,
                         device=jax.devices()[0].device_kind, prompt_tokens=[len(p) for p in batch[:8]]))
        print(f"batch {b:3d}: {tps:9.1f} tokens/s ({bundle.config.dtype}, {jax.devices()[0].device_kind})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
