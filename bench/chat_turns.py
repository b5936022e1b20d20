"""Time to the first text per chat turn: `Conversation` keeps its KV cache between turns, so a turn prefills only
its new message, against prefilling the whole history (`generate` with one new token on it, as a chat without
the cache would).

    python bench/chat_turns.py --method weaver --max-new-tokens 48 --json out.json

The shipped SmolLM2 pair (or `--model`), five made-up user messages, greedy; one untimed conversation first
compiles what the timed one runs; per turn: the history's length, the tokens prefilled, the milliseconds to the
first chunk and to the whole answer, and the history's full prefill (`generate`, `ar`, one new token).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import weaver_jax as wj  # noqa: E402
from weaver_jax._chat import Conversation  # noqa: E402

MESSAGES = ["Suggest a name for a bakery.", "Why that one?", "Give me a slogan for it.",
            "Now a shorter slogan.", "Summarise what we chose."]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--method", default="weaver")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bundle = wj.load(args.model)
    rows = []
    for timed in (False, True):
        chat = Conversation(bundle, method=args.method, max_new_tokens=args.max_new_tokens, context=1024)
        for turn, message in enumerate(MESSAGES, 1):
            ids = bundle.tokenizer.apply_chat_template(chat.messages + [{"role": "user", "content": message}])
            held = min(len(ids), len(chat.cached))  # the caches' tokens that this turn's history begins with
            common = next((i for i in range(held) if ids[i] != chat.cached[i]), held)
            t0 = time.perf_counter()
            stream = chat.reply(message)
            first = None
            for _ in stream:
                first = first or time.perf_counter() - t0
            seconds = time.perf_counter() - t0
            full = wj.generate(bundle, [ids], method="ar", max_new_tokens=1)
            if timed:
                rows.append(dict(turn=turn, history_tokens=len(ids), prefilled_tokens=len(ids) - common,
                                 first_text_ms=first * 1e3, answer_ms=seconds * 1e3, answer_tokens=len(stream.tokens),
                                 full_history_prefill_ms=full.stats["seconds"] * 1e3, method=args.method,
                                 device=jax.devices()[0].device_kind))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
