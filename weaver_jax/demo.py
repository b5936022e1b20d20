"""`make demo`: SmolLM2-135M-Instruct with its shipped drafter and Weaver adapter, on the machine's
fastest device, with `method="auto"` against plain decoding (`method="ar"`).

"auto" picks the method from this device's round times (measured on first use and kept) and the running
acceptance: on a GPU it speculates (Weaver or the chain); on a CPU every drafted round costs about three
decode steps, more than τ repays (BENCHMARKS.md, `bench/cpu_methods.py`), so it decodes plainly there. The
demo prints both texts' agreement, tokens/s, what "auto" chose, and says what an H200 gives.
"""

from __future__ import annotations

import time

import jax

import weaver_jax

PROMPT = "Explain in three sentences why the sky is blue."
# The H100 figures of BENCHMARKS.md's summary (bench/e2e.py, 48 held-out prompts, B = 1, greedy).
GPU_FIGURES = ("on an H100, Weaver at its defaults runs at 2.2x plain decoding, the chain at 2.4x "
               "(this pair, greedy, batch 1)")


def main():
    t0 = time.perf_counter()
    bundle = weaver_jax.load("smollm2-135m-instruct")
    gpu = jax.default_backend() == "gpu"
    print(f"loaded {bundle.name} ({bundle.config.num_layers} layers, {bundle.config.dtype}, {jax.default_backend()}) "
          f"with a {bundle.drafter.config.num_layers}-layer drafter and a width-{bundle.adapter.config.d_rank} adapter "
          f"in {time.perf_counter() - t0:.1f}s\n\nuser: {PROMPT}")
    ids = bundle.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    results = {method: weaver_jax.generate(bundle, [ids], method=method, max_new_tokens=128)
               for method in ("ar", "auto")}
    ar, auto = results["ar"], results["auto"]
    print(f"\n[ar] {bundle.tokenizer.decode(ar.tokens[0], skip_special_tokens=True)}\n"
          f"  {ar.stats['new_tokens']} tokens at {ar.stats['tokens_per_second']:.1f} tokens/s "
          f"(compile {ar.stats['compile_seconds']:.1f}s not counted)")
    settings = auto.stats["settings"]
    if settings.get("plain_program"):
        chose = "plain decoding's own program (no drafting tier pays here)"
    else:
        switches = ", ".join(f"{s['to']} at call {s['call']}" for s in settings["switches"]) or "no switch"
        rounds = ", ".join(f"{k} {v}" for k, v in settings["rounds"].items() if v)
        chose = f"{settings['start']} first, {switches} (rounds: {rounds})"
    measured = " after timing its tiers on this device (first use; kept for later calls)" * bool(
        settings.get("measured_now"))
    ratio = auto.stats["tokens_per_second"] / ar.stats["tokens_per_second"]
    print(f"\n[auto] identical text: {ar.tokens == auto.tokens}; {auto.stats['tokens_per_second']:.1f} tokens/s, "
          f"{ratio:.2f}x ar\n  chose {chose}{measured}")
    if not gpu:
        print(f"  On a CPU a drafted round costs compute that plain decoding does not spend; {GPU_FIGURES}\n"
              f"  (BENCHMARKS.md). `make demo` on a GPU machine runs there.")

if __name__ == "__main__":
    main()
