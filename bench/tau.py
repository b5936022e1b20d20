"""τ (tokens per target verification, bonus included) on held-out prompt sets (speed: bench/e2e.py).

    python bench/tau.py --model SmolLM2.gguf --eval-prompts eval_prompts.json --json tau.json

The bundle is `weaver_jax.load(--model)` (for the named model: the shipped drafter and adapter;
`--drafter` / `--adapter` override). Every prompt of every set (`weaver-jax train-prompts`'s
eval_prompts.json: MT-Bench first turns, HumanEval, held-out AlpacaEval) goes through the chat
template into one batch; each method and budget is one `generate` call at each temperature, and τ
per set is pooled from the per-prompt counts. Configurations compile concurrently (threads) and
results are appended to --json as they finish, so a rerun skips what is there for the same --drafter
and --adapter (each row names them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import weaver_jax as wj  # noqa: E402


def configurations(budgets, methods=("dflash", "ddtree", "weaver")):
    return [("dflash", None)] * ("dflash" in methods) + [(m, b) for m in ("ddtree", "weaver") if m in methods
                                                          for b in budgets]


def encode_sets(bundle, path: Path, limit: int):
    sets = json.loads(path.read_text())
    names, prompts = [], []
    for name, items in sets.items():
        for item in items[: limit or None]:
            names.append(name)
            prompts.append(bundle.tokenizer.apply_chat_template([{"role": "user", "content": item["text"]}]))
    return np.array(names), prompts


def run_tau(bundle, names, prompts, args, out_path: Path):
    rows = json.loads(out_path.read_text()) if out_path.exists() else []
    pair = dict(drafter=args.drafter or "shipped", adapter=args.adapter or "shipped")  # rows of other pairs stay
    weaver_options = parse_options(args.weaver_options)

    def options_label(method):  # what a row's "options" says, and part of what a rerun skips
        return ",".join(f"{k}={v}" for k, v in weaver_options.items()) if method == "weaver" else ""

    done = {(r["temperature"], r["method"], r["budget"], r.get("options", "")) for r in rows
            if (r.get("drafter"), r.get("adapter")) == (pair["drafter"], pair["adapter"])}
    todo = [(t, m, b) for t in args.temperatures for m, b in configurations(args.budgets, args.methods)
            if (t, m, b, options_label(m)) not in done]

    def one(config):
        temperature, method, budget = config
        options = ({} if budget is None else {"budget": budget}) | (weaver_options if method == "weaver" else {})
        result = wj.generate(bundle, prompts, method=method, max_new_tokens=args.max_new_tokens,
                             temperature=temperature, seed=args.seed, **options)
        return config, result.stats

    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        for (temperature, method, budget), stats in map(lambda f: f.result(), concurrent.futures.as_completed(
                [pool.submit(one, c) for c in todo])):
            ver = np.array(stats["sequence_verifications"])
            acc = np.array(stats["sequence_accepted_tokens"])
            for name in [*dict.fromkeys(names), "all"]:
                sel = np.ones(len(names), bool) if name == "all" else names == name
                rows.append(dict(**pair, set=name, temperature=temperature, method=method, budget=budget,
                                 options=options_label(method),
                                 tau=float(acc[sel].sum() / max(ver[sel].sum(), 1)), prompts=int(sel.sum()),
                                 verifications=int(ver[sel].sum()), compile_seconds=stats["compile_seconds"],
                                 device=jax.devices()[0].device_kind, max_new_tokens=args.max_new_tokens))
            print(json.dumps([r for r in rows[-4:]]), flush=True)
            out_path.write_text(json.dumps(rows, indent=1))
    return rows


def parse_options(text: str) -> dict:
    """"expansions_per_call=8,children_per_node=16" -> {"expansions_per_call": 8, "children_per_node": 16}."""
    options = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise SystemExit(f"options: expected name=integer pairs separated by commas, got {item!r}")
        options[name.strip()] = int(value)
    return options


def bundle_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, drafter, adapter and held-out prompts of a run (shared with bench/e2e.py)."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--drafter")
    parser.add_argument("--adapter")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--eval-prompts", type=Path, default=Path(".stage/prompts/eval_prompts.json"))


def load_bundle(args) -> wj.Bundle:
    bundle = wj.load(args.model, dtype=args.dtype, drafter=args.drafter, adapter=args.adapter)
    if bundle.drafter is None or bundle.adapter is None:
        raise SystemExit(f"{args.model}: no drafter/adapter (pass --drafter and --adapter)")
    return bundle


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bundle_arguments(parser)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--methods", nargs="+", choices=["dflash", "ddtree", "weaver"],
                        default=["dflash", "ddtree", "weaver"], help="e.g. dflash ddtree for a drafter alone")
    parser.add_argument("--weaver-options", default="",
                        help="more options for weaver, e.g. expansions_per_call=8 (rows name them)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--limit", type=int, default=0, help="first N prompts of each set (smoke tests)")
    parser.add_argument("--workers", type=int, default=4, help="configurations compiled at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    t0 = time.time()
    bundle = load_bundle(args)
    names, prompts = encode_sets(bundle, args.eval_prompts, args.limit)
    run_tau(bundle, names, prompts, args, args.json)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
