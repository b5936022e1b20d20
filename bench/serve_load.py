"""A bounded load test of `weaver-jax serve` on loopback: throughput and latency, speculation on and off.

    python bench/serve_load.py --concurrency 1 4 16 64 --requests 64 --max-tokens 256 --json out.json
    python bench/serve_load.py --model random --methods weaver --concurrency 16 --requests 64 --max-tokens 64

Starts the server in this process (uvicorn, 127.0.0.1, a free port) for the named model (default: the shipped
SmolLM2 pair), then for each method (`--methods`, "ar" = speculation off) and concurrency C sends `--requests`
chat requests from C client threads (the official `openai` client; in a process of their own, bench/load_client.py,
unless `--clients threads`), T = 0, EOS off so every answer has `--max-tokens` tokens: aggregate completion
tokens/s and p50 / p99 request latency, the slots' rows in use per call, where the engine's time went
(`engine_seconds`: `timed_engine`), and for method="auto" what its last slots chose. The server compiles its
programs for T = 0 first (`warmup`), and one untimed round of C requests precedes the timed ones. As the baseline,
one `generate` call on the same prompts (the first `--max-batch` of them as one batch) gives tokens/s
for `vs_generate_batch`. `steady_tokens_per_second`: the rate while all C clients are in flight (from the C-th
request's start to the first reply after the last request went out; each reply's tokens spread evenly over its
request's time), without the slots' filling at the start and draining at the end, which a run of a few requests
per client weighs heavily. It stops by itself.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import load_client  # noqa: E402  (beside this script)
from load_client import REQUESTS  # noqa: E402

import weaver_jax as wj  # noqa: E402
from weaver_jax import _generate, _stream  # noqa: E402
from weaver_jax._serve import Server  # noqa: E402


def steady_rate(spans: list[tuple[float, float, int]], concurrency: int) -> float | None:
    """Tokens/s while every client has a request in flight: spans are (start, end, tokens) per request, in the
    order sent; the window runs from the `concurrency`-th start to the first end after the last start."""
    starts = sorted(s for s, _, _ in spans)
    if len(spans) <= concurrency:
        return None
    begin = starts[concurrency - 1]
    end = min(e for _, e, _ in spans if e >= starts[-1])
    if end <= begin:
        return None
    tokens = sum(n * max(0.0, min(e, end) - max(s, begin)) / (e - s) for s, e, n in spans if e > s)
    return tokens / (end - begin)


@contextlib.contextmanager
def load(clients: str, base_url: str, concurrency: int, requests: int, max_tokens: int):
    """Clients that have sent a warm-up round of `concurrency` requests (what they need is compiled) -> a function
    that sends the `requests` timed ones -> [(start, end, completion tokens)] per request."""
    if clients == "threads":
        one = functools.partial(load_client.request, base_url, max_tokens)
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(concurrency)))
            yield lambda: list(pool.map(one, range(requests)))
        return
    command = [sys.executable, str(Path(__file__).with_name("load_client.py")), base_url, str(concurrency),
               str(requests), str(max_tokens)]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as process:
        if process.stdout.readline().strip() != "warm":
            raise RuntimeError("the client process ended before its warm-up round")

        def timed():
            process.stdin.write("go\n")
            process.stdin.flush()
            return [tuple(r) for r in json.loads(process.stdout.readline())]

        yield timed


ENGINE_SECONDS: collections.Counter = collections.Counter()


def timed_engine() -> None:
    """Count the engine thread's seconds in ENGINE_SECONDS: `sends` (dispatching the loop's calls), `reads`
    (waiting for a call's window: the device's time the host did not hide), `inserts` (dispatching the prefill of
    joining requests) and `receives` (reads, the wait for an insert's first tokens, what is done with the
    window)."""
    def wrap(cls, name: str, label: str):
        inner = getattr(cls, name)

        @functools.wraps(inner)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                ENGINE_SECONDS[label] += time.perf_counter() - t0

        setattr(cls, name, timed)

    wrap(_stream.Slots, "insert", "inserts")
    wrap(_stream.Slots, "send", "sends")
    wrap(_stream.Slots, "receive", "receives")
    wrap(_stream.Loop, "read", "reads")


def start(app) -> tuple[uvicorn.Server, int]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, server.servers[0].sockets[0].getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help='a name or path for weaver_jax.load, or "random": a small random bundle (a CPU check)')
    parser.add_argument("--methods", nargs="+", default=["weaver", "ar"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--slot-call-seconds", type=float, default=_stream.SLOT_CALL_SECONDS,
                        help="how long the server's calls aim to take (_stream.SLOT_CALL_SECONDS)")
    parser.add_argument("--clients", choices=["process", "threads"], default="process",
                        help="the clients in a process of their own (bench/load_client.py: as real clients, they "
                             "share no interpreter lock with the server), or threads of the server's process")
    parser.add_argument("--pipeline", action="store_true", help="the engine sends each call before reading the "
                        "last (Server(pipeline=True))")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    timed_engine()
    _stream.SLOT_CALL_SECONDS = args.slot_call_seconds
    if args.model == "random":  # the server's host-side costs on a CPU in seconds: a small random bundle
        bundle = wj.testing.random_bundle(0, tokenizer=True, eos_token_ids=(1,), block_size=8)
    else:
        bundle = wj.load(args.model)
    bundle = wj.Bundle(bundle.target, bundle.tokenizer, bundle.drafter, bundle.adapter, eos_token_ids=(),
                       name=bundle.name)  # EOS off: every answer is max_tokens long
    rows = []
    for method in args.methods:
        app = Server(bundle, model_name="m", method=method, max_batch=args.max_batch, max_queue=4 * args.requests,
                     warmup=(0.0,), pipeline=args.pipeline)
        server, port = start(app.app)
        base_url = f"http://127.0.0.1:{port}/v1"
        prompts = [bundle.tokenizer.apply_chat_template([{"role": "user", "content": REQUESTS[i % len(REQUESTS)]}])
                   for i in range(args.max_batch)]
        options = dict(method=method, max_new_tokens=args.max_tokens, eos_token_id=[])
        wj.generate(bundle, prompts, **options)  # compiled
        base = wj.generate(bundle, prompts, **options).stats["tokens_per_second"]
        for concurrency in args.concurrency:
            with load(args.clients, base_url, concurrency, args.requests, args.max_tokens) as timed_requests:
                programs, calls = len(_generate._COMPILED), len(app.engine.batch_sizes)  # after a warm-up round
                ENGINE_SECONDS.clear()
                t0 = time.perf_counter()
                results = timed_requests()
                seconds = time.perf_counter() - t0
                engine = dict(ENGINE_SECONDS)
                compiled = len(_generate._COMPILED) - programs  # compiled while timed (batch sizes not warmed)
            latencies = sorted(end - begin for begin, end, _ in results)
            tokens = sum(r[2] for r in results)
            steady = steady_rate(results, concurrency)
            rows_per_call = collections.Counter(app.engine.batch_sizes[calls:])  # the slots' rows in use per call
            slots = app.engine.slots
            pilot = slots and slots.autopilot  # method="auto": what its last slots chose and saw
            rows.append(dict(method=method, concurrency=concurrency, requests=args.requests,
                             rows_per_call=dict(sorted(rows_per_call.items())),
                             auto=pilot.settings() if pilot else slots and slots.plan and slots.plan.settings(),
                             max_tokens=args.max_tokens, tokens_per_second=tokens / seconds,
                             p50_seconds=statistics.median(latencies),
                             p99_seconds=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                             generate_batch_tokens_per_second=base, vs_generate_batch=tokens / seconds / base,
                             steady_tokens_per_second=steady, steady_vs_generate_batch=steady and steady / base,
                             max_batch=args.max_batch, compiled_while_timed=compiled,
                             slot_call_seconds=args.slot_call_seconds, clients=args.clients, pipeline=args.pipeline,
                             engine_seconds={k: round(v, 4) for k, v in sorted(engine.items())},
                             device=jax.devices()[0].device_kind))
            print(json.dumps(rows[-1]), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
        server.should_exit = True


if __name__ == "__main__":
    main()
