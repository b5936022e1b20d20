"""Which method and settings are fastest on this machine's CPU (what `make demo` runs there).

    python bench/cpu_methods.py --json bench/results/DATE_smollm2_cpu_methods.json

The shipped SmolLM2 pair, float32, greedy, a few chat prompts one at a time (one padded length, so
each configuration compiles once), `--max-new-tokens` each, EOS on; tokens/s over all of them
(compile excluded) against `ar` in the same run, and τ.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax  # noqa: E402
from e2e import generate  # noqa: E402

import weaver_jax as wj  # noqa: E402

PROMPTS = ["Explain in three sentences why the sky is blue.", "Write a Python function that checks whether a number "
           "is prime.", "Give me three tips for a job interview.", "What is the difference between a list and a tuple?"]
CONFIGS = ["ar", "dflash", "dflash:depth=1", "dflash:depth=2", "dflash:depth=3", "dflash:depth=4", "dflash:depth=6",
           "ddtree:budget=4,depth=2", "weaver:budget=4,depth=2", "weaver:budget=8,depth=3", "weaver:budget=16"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=CONFIGS)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bundle = wj.load("smollm2-135m-instruct")
    ids = [bundle.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    rows = []
    for config in args.config:
        tokens = seconds = verifications = accepted = 0
        for prompt in ids:
            out = generate(bundle, [prompt], config, max_new_tokens=args.max_new_tokens, pad_to=64)
            tokens, seconds = tokens + out.stats["new_tokens"], seconds + out.stats["seconds"]
            verifications += sum(out.stats.get("sequence_verifications", [0]))
            accepted += sum(out.stats.get("sequence_accepted_tokens", [0]))
        rows.append(dict(config=config, tokens_per_second=tokens / seconds,
                         tau=accepted / verifications if verifications else 1.0, new_tokens=tokens,
                         device=jax.devices()[0].device_kind, cores=os.cpu_count()))
        rows[-1]["vs_ar"] = rows[-1]["tokens_per_second"] / rows[0]["tokens_per_second"]
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
