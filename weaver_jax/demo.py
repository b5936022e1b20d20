"""`make demo`: SmolLM2-135M-Instruct with its shipped drafter and Weaver adapter, on CPU.

Plain decoding (`method="ar"`) and Weaver (`method="weaver"`) on one chat-templated prompt at
temperature 0: the texts are identical by construction; τ says how many tokens each target
verification emitted. On a CPU, verifying a tree costs about as many FLOPs as decoding its nodes
one by one, so tokens/s favours plain decoding there; the speedup needs an accelerator, where a
verification costs about one decode step (BENCHMARKS.md).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import weaver_jax  # noqa: E402

PROMPT = "Explain in three sentences why the sky is blue."
BUDGET = 16  # small on CPU, where every tree node costs compute


def main():
    t0 = time.perf_counter()
    bundle = weaver_jax.load("smollm2-135m-instruct")
    print(f"loaded {bundle.name} ({bundle.config.num_layers} layers, {bundle.config.dtype}) with a "
          f"{bundle.drafter.config.num_layers}-layer drafter and a width-{bundle.adapter.config.d_rank} adapter "
          f"in {time.perf_counter() - t0:.1f}s\n\nuser: {PROMPT}")
    ids = bundle.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    texts = {}
    for method, options in (("ar", {}), ("weaver", {"budget": BUDGET})):
        result = weaver_jax.generate(bundle, [ids], method=method, max_new_tokens=128, **options)
        s = result.stats
        texts[method] = bundle.tokenizer.decode(result.tokens[0], skip_special_tokens=True)
        tau = f", tau {s['mean_accepted_length']:.2f} tokens per verification" if method != "ar" else ""
        print(f"\n[{method}{f', budget {BUDGET}' if options else ''}] {texts[method]}\n"
              f"  {s['new_tokens']} tokens in {s['seconds']:.2f}s: {s['tokens_per_second']:.1f} tokens/s{tau} "
              f"(greedy, CPU; compile {s['compile_seconds']:.1f}s not counted)")
    print(f"\nidentical texts: {texts['ar'] == texts['weaver']}")


if __name__ == "__main__":
    main()
