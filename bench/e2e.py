"""End to end, as a user runs it: tokens/s of every method through `weaver_jax.generate`, against
`method="ar"` in the same run, on held-out prompts of the real SmolLM2 pair.

    python bench/e2e.py --model SmolLM2.gguf --drafter D --adapter A --eval-prompts eval_prompts.json \
        --batch 1 8 --temperatures 0 --config ar dflash ddtree:budget=64 weaver:budget=64 --json out.json

Prompts: the first `--per-set` of each held-out set (MT-Bench first turns, HumanEval, held-out
AlpacaEval; `weaver-jax train-prompts`), chat-templated, every one padded to the same length
(`generate(pad_to=...)`) so each configuration compiles once. At batch B the prompts go in groups of
B in a fixed order (`--mixed`: round robin over the sets, so every batch mixes chat, code and writing);
EOS on, `--max-new-tokens` each. Every configuration is compiled (and run once)
first, concurrently; then each is timed in turn: tokens/s = new tokens / seconds summed over its
`generate` calls (compile excluded), τ pooled over all prompts, and the share of prompts whose tokens
equal those of `ar` with the same `exact` setting and seeds (`same_as_ar`; at T > 0 too: sampling is
seed-identical). A configuration is `method` or `method:option=value,...` (generate's method options,
and `exact=1` for exact mode), optionally ending in `@all` / `@xla` (every Pallas kernel / none,
instead of the library's default selection). `vs_ar` is always against plain `ar`. `--mesh DxM`: the bundle
`weaver_jax.shard`ed over D x M devices (issue 38: `--mesh 2x1 --batch 16` against one device at `--batch 8`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tau import bundle_arguments, encode_sets, load_bundle, parse_options  # noqa: E402

import weaver_jax as wj  # noqa: E402
from weaver_jax import cli  # noqa: E402
from weaver_jax.pallas_kernels import KERNELS, kernel_scope  # noqa: E402


def parse_config(text: str) -> tuple[str, dict, tuple[str, ...] | None]:
    """`method:option=value,...@kernels` -> (method, options, kernels: None for the default selection)."""
    text, _, kernels = text.partition("@")
    method, _, rest = text.partition(":")
    options = parse_options(rest)
    if "exact" in options:
        options["exact"] = bool(options["exact"])
    selection = {"": None, "all": KERNELS, "xla": ()}
    if kernels not in selection:
        raise ValueError(f"unknown kernel selection @{kernels} (use @all or @xla)")
    return method, options, selection[kernels]


def generate(bundle, prompts, config: str, **kwargs):
    method, options, kernels = parse_config(config)
    with contextlib.nullcontext() if kernels is None else kernel_scope(kernels):
        return wj.generate(bundle, prompts, method=method, **options, **kwargs)


def run(bundle, prompts, config: str, batch: int, temperature: float, args) -> tuple[dict, list]:
    pad = -(-max(len(p) for p in prompts) // 32) * 32
    tokens = seconds = verifications = accepted = 0
    texts, settings = [], []
    for first in range(0, len(prompts), batch):
        out = generate(bundle, prompts[first:first + batch], config, max_new_tokens=args.max_new_tokens,
                       temperature=temperature, seed=first, pad_to=pad)
        tokens, seconds = tokens + out.stats["new_tokens"], seconds + out.stats["seconds"]  # compile excluded
        verifications += sum(out.stats.get("sequence_verifications", [0]))
        accepted += sum(out.stats.get("sequence_accepted_tokens", [0]))
        texts += out.tokens
        if "settings" in out.stats:  # method="auto": what each batch ran (start, switches, rounds per tier)
            chosen = out.stats["settings"]
            settings.append({k: chosen.get(k) for k in ("start", "plain_program", "rounds", "spread",
                                                        "slowest_predictability", "predictability")}
                            | {"switches": [(s["call"], s["to"]) for s in chosen.get("switches", [])]})
    row = dict(config=config, batch=batch, temperature=temperature, tokens_per_second=tokens / seconds,
               dtype=str(bundle.config.dtype),
               tau=accepted / verifications if verifications else 1.0, new_tokens=tokens, seconds=seconds,
               prompts=len(prompts), max_new_tokens=args.max_new_tokens, mesh=args.mesh,
               device=jax.devices()[0].device_kind,
               **({"settings": settings} if settings else {}))
    return row, texts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bundle_arguments(parser)
    parser.add_argument("--per-set", type=int, default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument("--config", nargs="+", default=["ar", "dflash", "ddtree:budget=64", "weaver:budget=64"])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--mixed", action="store_true", help="batches mix the sets (issue 41's mixed batch) "
                        "instead of taking them in order")
    parser.add_argument("--workers", type=int, default=8, help="configurations compiled at once")
    parser.add_argument("--mesh", help="DATAxMODEL: the bundle over that many devices, e.g. 2x1")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    t0 = time.time()
    bundle = load_bundle(args)
    if args.mesh:
        bundle = wj.shard(bundle, cli._mesh(args.mesh))
    names, prompts = encode_sets(bundle, args.eval_prompts, args.per_set)
    if args.mixed:  # round robin over the sets: every batch of B >= 3 holds chat, code and writing prompts
        rank = [int((names[:i] == name).sum()) for i, name in enumerate(names)]
        prompts = [prompts[i] for i in sorted(range(len(prompts)), key=lambda i: (rank[i], i))]
    pad = -(-max(len(p) for p in prompts) // 32) * 32
    configs = list(dict.fromkeys(["ar", *args.config]))  # ar first: the baseline
    jobs = [(c, b, t) for t in args.temperatures for b in args.batch for c in configs]

    def warm(job):  # compile, and run one group, so the timed runs start warm
        generate(bundle, prompts[: job[1]], job[0], max_new_tokens=args.max_new_tokens, temperature=job[2],
                 pad_to=pad)

    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(warm, jobs))
    print(f"compiled {len(jobs)} configurations in {time.time() - t0:.0f} s", flush=True)
    rows, base, ar_texts = [], {}, {}
    for config, batch, temperature in jobs:
        row, texts = run(bundle, prompts, config, batch, temperature, args)
        method, options, _ = parse_config(config)
        mode = batch, temperature, options.get("exact", False)
        if config == "ar":
            base[batch, temperature] = row["tokens_per_second"]
        if method == "ar" and mode not in ar_texts:
            ar_texts[mode] = texts
        row["vs_ar"] = row["tokens_per_second"] / base[batch, temperature]
        if mode in ar_texts:
            same = [a == b for a, b in zip(texts, ar_texts[mode], strict=True)]
            row["same_as_ar"] = sum(same) / len(same)
        row["mixed"] = args.mixed
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
