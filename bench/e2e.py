"""End to end, as a user runs it: tokens/s of every method through `weaver_jax.generate`, against
`method="ar"` in the same run, on held-out prompts of the real SmolLM2 pair.

    python bench/e2e.py --model SmolLM2.gguf --drafter D --adapter A --eval-prompts eval_prompts.json \
        --batch 1 8 --temperatures 0 --config ar dflash ddtree:budget=64 weaver:budget=64 --json out.json

Prompts: the first `--per-set` of each held-out set (MT-Bench first turns, HumanEval, held-out
AlpacaEval; `weaver-jax train-prompts`), chat-templated, every one padded to the same length
(`generate(pad_to=...)`) so each configuration compiles once. At batch B the prompts go in groups of
B in a fixed order; EOS on, `--max-new-tokens` each. Every configuration is compiled (and run once)
first, concurrently; then each is timed in turn: tokens/s = new tokens / seconds summed over its
`generate` calls (compile excluded), τ pooled over all prompts. A configuration is `method` or
`method:option=value,...` (generate's method options).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import weaver_jax as wj  # noqa: E402


def parse_config(text: str) -> tuple[str, dict]:
    method, _, rest = text.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        name, _, value = item.partition("=")
        options[name] = int(value)
    return method, options


def held_out_prompts(bundle, path: Path, per_set: int) -> list[list[int]]:
    sets = json.loads(path.read_text())
    return [bundle.tokenizer.apply_chat_template([{"role": "user", "content": item["text"]}])
            for items in sets.values() for item in items[:per_set]]


def run(bundle, prompts, config: str, batch: int, temperature: float, args) -> dict:
    method, options = parse_config(config)
    pad = -(-max(len(p) for p in prompts) // 32) * 32
    tokens = seconds = verifications = accepted = 0
    for first in range(0, len(prompts), batch):
        group = prompts[first:first + batch]
        out = wj.generate(bundle, group, method=method, max_new_tokens=args.max_new_tokens, temperature=temperature,
                          seed=first, pad_to=pad, **options)
        tokens, seconds = tokens + out.stats["new_tokens"], seconds + out.stats["seconds"]  # compile excluded
        verifications += sum(out.stats.get("sequence_verifications", [0]))
        accepted += sum(out.stats.get("sequence_accepted_tokens", [0]))
    return dict(config=config, method=method, options=options, batch=batch, temperature=temperature,
                tokens_per_second=tokens / seconds, tau=accepted / verifications if verifications else 1.0,
                new_tokens=tokens, seconds=seconds, prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                device=jax.devices()[0].device_kind)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--drafter")
    parser.add_argument("--adapter")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--eval-prompts", type=Path, default=Path(".stage/prompts/eval_prompts.json"))
    parser.add_argument("--per-set", type=int, default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument("--config", nargs="+", default=["ar", "dflash", "ddtree:budget=64", "weaver:budget=64"])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8, help="configurations compiled at once")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    t0 = time.time()
    bundle = wj.load(args.model, dtype=args.dtype, drafter=args.drafter, adapter=args.adapter)
    prompts = held_out_prompts(bundle, args.eval_prompts, args.per_set)
    pad = -(-max(len(p) for p in prompts) // 32) * 32
    configs = list(dict.fromkeys(["ar", *args.config]))  # ar first: the baseline
    jobs = [(c, b, t) for t in args.temperatures for b in args.batch for c in configs]

    def warm(job):  # compile, and run one group, so the timed runs start warm
        method, options = parse_config(job[0])
        wj.generate(bundle, prompts[: job[1]], method=method, max_new_tokens=args.max_new_tokens,
                    temperature=job[2], pad_to=pad, **options)

    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(warm, jobs))
    print(f"compiled {len(jobs)} configurations in {time.time() - t0:.0f} s", flush=True)
    rows, base = [], {}
    for config, batch, temperature in jobs:
        row = run(bundle, prompts, config, batch, temperature, args)
        if config == "ar":
            base[batch, temperature] = row["tokens_per_second"]
        row["vs_ar"] = row["tokens_per_second"] / base[batch, temperature]
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
