"""`make demo`: SmolLM2-135M-Instruct with its shipped drafter and Weaver adapter, on the machine's
fastest device and with the method measured fastest there.

On a GPU: plain decoding (`method="ar"`) against Weaver at its defaults, both texts, τ and tokens/s.
On a CPU, plain decoding is the fastest method (BENCHMARKS.md, `bench/cpu_methods.py`: every
speculative round costs at least 1.5 decode steps of compute there, more than τ repays), so the
demo times `ar` only; it also runs Weaver to show that its text is the same and how many tokens each
target pass emitted, and says what an H200 gives.
"""

from __future__ import annotations

import time

import jax

import weaver_jax

PROMPT = "Explain in three sentences why the sky is blue."
# The H200 figures of BENCHMARKS.md's summary (bench/e2e.py, 48 held-out prompts, B = 1, greedy).
GPU_FIGURES = "on an H200, Weaver at its defaults runs at 2.3-2.4x plain decoding (this pair, greedy, batch 1)"


def main():
    t0 = time.perf_counter()
    bundle = weaver_jax.load("smollm2-135m-instruct")
    gpu = jax.default_backend() == "gpu"
    print(f"loaded {bundle.name} ({bundle.config.num_layers} layers, {bundle.config.dtype}, {jax.default_backend()}) "
          f"with a {bundle.drafter.config.num_layers}-layer drafter and a width-{bundle.adapter.config.d_rank} adapter "
          f"in {time.perf_counter() - t0:.1f}s\n\nuser: {PROMPT}")
    ids = bundle.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    results = {method: weaver_jax.generate(bundle, [ids], method=method, max_new_tokens=128)
               for method in ("ar", "weaver")}
    ar, weaver = results["ar"], results["weaver"]
    print(f"\n[ar] {bundle.tokenizer.decode(ar.tokens[0], skip_special_tokens=True)}")
    speed = f"{ar.stats['new_tokens']} tokens at {ar.stats['tokens_per_second']:.1f} tokens/s"
    tau = weaver.stats["mean_accepted_length"]
    if gpu:
        ratio = weaver.stats["tokens_per_second"] / ar.stats["tokens_per_second"]
        print(f"  {speed}\n\n[weaver] {bundle.tokenizer.decode(weaver.tokens[0], skip_special_tokens=True)}\n"
              f"  {weaver.stats['tokens_per_second']:.1f} tokens/s: {ratio:.2f}x ar, {tau:.2f} tokens per target pass"
              f"\n\nidentical texts: {ar.tokens == weaver.tokens}")
    else:
        print(f"  {speed} (greedy, CPU: the fastest method here; compile {ar.stats['compile_seconds']:.1f}s not "
              f"counted)\n\n[weaver] identical text: {ar.tokens == weaver.tokens}, {tau:.2f} tokens per target pass.\n"
              f"  On a CPU a target pass over a tree costs compute that plain decoding does not spend, so Weaver is\n"
              f"  slower here; {GPU_FIGURES}\n  (BENCHMARKS.md). `make demo` on a GPU machine runs there.")


if __name__ == "__main__":
    main()
