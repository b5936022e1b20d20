"""Does every method give `ar`'s tokens on the real pair, and where it does not, is rounding the reason?

    python bench/agreement.py --model SmolLM2.gguf --drafter D --adapter A --eval-prompts eval_prompts.json \
        --per-set 16 --config dflash ddtree:budget=64 weaver --json out.json

For each configuration, default mode and `exact=True`: the prompts whose greedy tokens (and, at
`--temperature`, seeded sampled tokens) equal `ar`'s in the same mode, batch `--batch`.

Each greedy difference of the default mode is then explained or not by rounding
(`weaver_jax.testing.rounding_explanation`: at the first differing token, the float32 logits of the
two choices are within twice the bfloat16 target's largest logit error there).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import generate  # noqa: E402
from tau import bundle_arguments, encode_sets, load_bundle  # noqa: E402

from weaver_jax.testing import float32_copy, rounding_explanation  # noqa: E402


def with_exact(config: str, exact: bool) -> str:
    """An e2e.py configuration with `exact=1` added when exact."""
    if not exact:
        return config
    text, at, kernels = config.partition("@")
    return f"{text}{',' if ':' in text else ':'}exact=1{at}{kernels}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bundle_arguments(parser)
    parser.add_argument("--per-set", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0, help="also compare seeded samples at this T")
    parser.add_argument("--config", nargs="+", default=["dflash", "ddtree:budget=64", "weaver"])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    t0 = time.time()
    bundle = load_bundle(args)
    reference = float32_copy(bundle.target)
    prompts = encode_sets(bundle, args.eval_prompts, args.per_set)[1]
    pad = -(-max(len(p) for p in prompts) // 32) * 32

    def run(config, temperature):
        out = []
        for first in range(0, len(prompts), args.batch):
            out += generate(bundle, prompts[first:first + args.batch], config, max_new_tokens=args.max_new_tokens,
                            temperature=temperature, seed=first, pad_to=pad).tokens
        return out

    temperatures = sorted({0.0, args.temperature})
    jobs = [(with_exact(c, exact), t) for exact in (False, True) for t in temperatures for c in ["ar", *args.config]]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # compile every configuration at once first
        list(pool.map(lambda job: generate(bundle, prompts[: args.batch], job[0], max_new_tokens=args.max_new_tokens,
                                           temperature=job[1], pad_to=pad), jobs))
    print(f"compiled {len(jobs)} configurations in {time.time() - t0:.0f} s", flush=True)
    rows = []
    for exact in (False, True):
        for temperature in temperatures:
            ar = run(with_exact("ar", exact), temperature)
            for config in args.config:
                spec = run(with_exact(config, exact), temperature)
                same = [a == s for a, s in zip(ar, spec, strict=True)]
                row = dict(config=config, exact=exact, temperature=temperature, batch=args.batch, prompts=len(prompts),
                           same_as_ar=sum(same), dtype=str(bundle.config.dtype),
                           device=jax.devices()[0].device_kind)
                if temperature == 0 and not exact:
                    row["differences"] = [rounding_explanation(bundle.target, reference, prompts[j], ar[j], spec[j])
                                          for j in range(len(prompts)) if not same[j]]
                    row["explained"] = sum(d["explained"] for d in row["differences"])
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "differences"}), flush=True)
                args.json.write_text(json.dumps(rows, indent=1))
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
