"""The clients of bench/serve_load.py in a process of their own (`--clients process`, the default), as real clients
are: none shares the server's interpreter lock. Imports the `openai` client alone, not jax.

    python bench/load_client.py URL CONCURRENCY REQUESTS MAX_TOKENS < go

Sends CONCURRENCY requests (a warm-up), prints "warm", waits for a line on stdin, sends REQUESTS from CONCURRENCY
threads and prints one JSON line: [start, end, completion tokens] per request, times by `time.perf_counter` (the
system's monotonic clock, the same in every process).
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
import time

import openai

# Made-up requests (in none of the project's prompt sets): only their lengths and variety matter here (each <= 64
# tokens with its chat template, even under `--model random`'s byte tokenizer: the server's warm-up covers them).
REQUESTS = [
    "Write a haiku about autumn leaves.", "Give me three tips for learning to cook.",
    "Explain what a hash table is.", "Summarise a heist movie you invent.",
    "List five uses for a paperclip.", "Describe the water cycle for a child.",
    "What makes a good password?", "Draft a polite email declining a meeting.",
]
_LOCAL = threading.local()


def request(base_url: str, max_tokens: int, i: int) -> tuple[float, float, int]:
    """Request i (one of REQUESTS, T = 0) from this thread's client -> (start, end, completion tokens)."""
    if getattr(_LOCAL, "client", None) is None:
        _LOCAL.client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    reply = _LOCAL.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": REQUESTS[i % len(REQUESTS)]}], max_tokens=max_tokens,
        temperature=0)
    return t0, time.perf_counter(), reply.usage.completion_tokens


def main():
    base_url, concurrency, requests, max_tokens = sys.argv[1], *map(int, sys.argv[2:5])
    one = lambda i: request(base_url, max_tokens, i)  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(concurrency)))
        print("warm", flush=True)
        sys.stdin.readline()
        print(json.dumps(list(pool.map(one, range(requests)))), flush=True)


if __name__ == "__main__":
    main()
