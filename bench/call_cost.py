"""What a chunked-loop call costs besides its rounds (streaming and the server run a few rounds per call), one
sequence: per-call time at 0, 1 and 16 rounds a call against a decode step inside `generate`; how long sending a
call takes against the call (a call whose loop runs from the host returns only once the loop has ended); and one
sequence's time through calls of 16 and 64 rounds, each read before the next is sent ("serial") or through
`_stream.Run`, which sends each call before reading the last ("ahead"), against `generate`'s.

    python bench/call_cost.py --json out.json
    XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN python bench/call_cost.py

A random target of SmolLM2's shape with the shipped drafter and adapter (no GGUF needed), 96-token prompt, EOS off,
`ar` and Weaver's defaults, through `_stream.Loop` (the halted rows and the rounds uploaded once); each per-call
figure the mean over the calls of one sequence after an untimed one, each sequence figure the median of 4.
fixed_ms = per-call time at 1 round less one round's time inside `generate`; a call of 0 rounds is the dispatch
alone (no loop body runs). XLA_FLAGS that set the command buffers' list replace `_generate.ASYNC_LOOP` (the
second command above: XLA's default, the loop run from the host). Measured on an H200 (BENCHMARKS, issue 40):
a 0-round call 1.5 ms for `ar`, 2.3 for Weaver under XLA's defaults, no cheaper under any flag tried; with
the loop as a command buffer a 16-round call is sent in 1.7 ms instead of 17.4, and sending ahead makes a
sequence as fast as `generate`. `--profile`: GPU traces of `generate`'s loop and of 16-round calls.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import round_profile  # noqa: E402
from kernel_times import gpu_timeline  # noqa: E402

import weaver_jax as wj  # noqa: E402
from weaver_jax import _generate, _stream  # noqa: E402
from weaver_jax._speculative import spec_advance  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-target", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--compiler-options", type=json.loads, default={},
                        help='XLA options for every program (_generate.COMPILER_OPTIONS), as JSON')
    parser.add_argument("--profile", action="store_true",
                        help="GPU traces of generate's loop and of 16-round calls: busy time, kernels, gaps per round")
    parser.add_argument("--hlo-dir", type=Path, help="with --profile: write both programs' optimized HLO there")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    _generate.COMPILER_OPTIONS.update(ar=args.compiler_options, spec=args.compiler_options)
    bundle = round_profile.bundle_for(argparse.Namespace(
        random_target=args.random_target, dtype=None, drafter=None, adapter=None, drafter_layers=0, adapter_shape={}))
    prompt, new = list(range(1, 97)), args.max_new_tokens
    rows = []
    for method in ("ar", "weaver"):
        options = dict(max_new_tokens=new, eos_token_id=[], method=method)
        wj.generate(bundle, [prompt], **options)
        out = wj.generate(bundle, [prompt], **options)
        round_ms = out.stats["seconds"] / out.stats["rounds"] * 1e3
        row = dict(method=method, round_ms_in_generate=round_ms, xla_flags=os.environ.get("XLA_FLAGS", ""),
                   compiler_options=args.compiler_options,
                   device=jax.devices()[0].device_kind)
        _, static, loop_args = _generate._prepare(bundle, [prompt], method, new, 0.0, 0, 1.0, 0, [], {})
        loop = _stream.Loop(bundle, method, static, loop_args, rounds_per_call=1)
        state, halted = loop.start(loop_args), np.zeros((1,), bool)
        for i in range(21):  # a call of no rounds: dispatch, arguments and the window alone (no loop body runs)
            if i == 1:
                t0 = time.perf_counter()
            state, window = loop.send(state, loop.keys, halted, rounds=0)
            np.asarray(window)
        row["call_ms_at_0_rounds"] = (time.perf_counter() - t0) / 20 * 1e3
        for rounds in (1, 16):
            for _ in range(2):  # the first compiles
                loop, state = fresh_loop(bundle, method, prompt, new, rounds)
                t0 = time.perf_counter()
                state, got, calls = drain(loop, state, new)
                seconds = time.perf_counter() - t0
            row[f"call_ms_at_{rounds}_rounds"] = seconds / calls * 1e3
            row[f"same_tokens_as_generate_at_{rounds}_rounds"] = got == out.tokens[0][1:]  # a flag must not change them
        row["fixed_ms"] = row["call_ms_at_1_rounds"] - round_ms
        row["generate_ms"] = statistics.median(timed(wj.generate, bundle, [prompt], **options) for _ in range(4))
        for rounds in (16, 64):
            loop, state = fresh_loop(bundle, method, prompt, new, rounds)
            sent, total = [], []
            for _ in range(4):
                t0 = time.perf_counter()
                state, window = loop.send(state, loop.keys, np.zeros((1,), bool))
                sent.append(time.perf_counter() - t0)
                np.asarray(window)
                total.append(time.perf_counter() - t0)
            row[f"send_ms_at_{rounds}_rounds"] = statistics.median(sent) * 1e3
            row[f"call_ms_at_{rounds}_rounds_sent"] = statistics.median(total) * 1e3
            for name, ms in sequence_ms(bundle, method, prompt, new, rounds, out.tokens[0]).items():
                row[f"sequence_ms_{name}_{rounds}_rounds"] = ms
        if args.profile:
            row["profile"] = profile(bundle, method, prompt, new, args.hlo_dir)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def fresh_loop(bundle, method: str, prompt: list[int], new: int, rounds_per_call: int, wait: bool = True):
    """A `_stream.Loop` of `rounds_per_call` rounds a call, its prefill sent (and done, with `wait`): -> (loop,
    state)."""
    _, static, loop_args = _generate._prepare(bundle, [prompt], method, new, 0.0, 0, 1.0, 0, [], {})
    loop = _stream.Loop(bundle, method, static, loop_args, rounds_per_call=rounds_per_call)
    state = loop.start(loop_args)
    if wait:
        np.asarray(state.tokens)
    return loop, state


def drain(loop, state, new: int):
    """Calls until the sequence has its tokens: -> (state, the tokens after the prefill's, calls)."""
    got, calls = [], 0
    while len(got) < new - 1:  # the prefill made the first token
        state, window = loop.advance(state, loop.keys, np.zeros((1,), bool))
        got += [int(t) for t in window[0] if t >= 0]
        calls += 1
    return state, got, calls


def sequence_ms(bundle, method: str, prompt: list[int], new: int, rounds: int, want: list[int]) -> dict:
    """One sequence through calls of `rounds`, read one by one (`drain`: "serial") and through `_stream.Run`, which
    sends each call before reading the last ("ahead"): -> the median milliseconds of 4 each, from the prefill's
    sending (as in `generate`) to the last token; the tokens checked against `want`."""
    made = {"serial": lambda: fresh_loop(bundle, method, prompt, new, rounds, wait=False),
            "ahead": lambda: _stream.Run(bundle, [prompt], method=method, max_new_tokens=new, eos_token_id=[],
                                         rounds_per_call=rounds)}
    emitted = {"serial": lambda loop_state: drain(*loop_state, new)[1],
               "ahead": lambda run: [t for chunk in run for t in chunk[0]][1:]}
    result = {}
    for name in made:
        runs = []
        for _ in range(4):
            started = made[name]()
            t0 = time.perf_counter()
            tokens = emitted[name](started)
            runs.append((time.perf_counter() - t0) * 1e3)
            assert tokens == want[1:], name
        result[name] = statistics.median(runs)
    return result


def timed(run, *args, **kwargs) -> float:
    """Milliseconds `run(*args, **kwargs)` takes (its result waited for)."""
    t0 = time.perf_counter()
    jax.block_until_ready(run(*args, **kwargs))
    return (time.perf_counter() - t0) * 1e3


def loop_iterations(state) -> int:
    """Loop-body runs so far: ar's steps count its prefill, a speculative state's rounds do not."""
    return int(state.step) - 1 if hasattr(state, "step") else int(state.rounds)


def timeline(hlo: str, events, rounds: int, calls: int) -> dict:
    """Per round: GPU busy time and kernels inside the loop, the GPU's idle time between them by gap size, and
    kernel kinds (names less numbers); per call: what runs outside the loop."""
    stages = round_profile.op_stages(hlo)
    stage = lambda e: stages.get(round_profile._key(e.op)) or stages.get(round_profile._key(e.kernel)) or "?"  # noqa: E731
    inside = [e for e in events if stage(e) != "prefill"]
    outside = [e for e in events if stage(e) == "prefill"]
    gaps = collections.Counter()
    for a, b in itertools.pairwise(inside):
        idle = (b.start_ns - a.start_ns) / 1e3 - a.us
        gaps[next(label for label, top in GAP_BUCKETS if idle < top)] += max(idle, 0.0) / rounds
    kinds = collections.defaultdict(lambda: [0.0, 0.0])
    for e in inside:
        kind = kinds[re.sub(r"[_.]?\d+", "", e.kernel)[:60]]
        kind[0] += 1 / rounds
        kind[1] += e.us / rounds
    return dict(rounds=rounds, calls=calls, busy_us_per_round=sum(e.us for e in inside) / rounds,
                kernels_per_round=len(inside) / rounds, idle_us_per_round=dict(gaps),
                outside_loop_us_per_call=sum(e.us for e in outside) / calls,
                outside_loop_kernels_per_call=len(outside) / calls,
                kinds={k: [round(n, 2), round(us, 2)] for k, (n, us) in sorted(kinds.items(), key=lambda i: -i[1][1])})


GAP_BUCKETS = (("<5us", 5), ("5-50us", 50), ("50-500us", 500), (">500us", float("inf")))


def profile(bundle, method: str, prompt: list[int], new: int, hlo_dir: Path | None) -> dict:
    """The same sequence through `generate`'s loop and through 16-round calls, each under the profiler."""
    fn, static, args = _generate._prepare(bundle, [prompt], method, new, 0.0, 0, 1.0, 0, [], {})
    compiled = _generate._compiled(fn, static, *args)
    events = gpu_timeline(lambda: compiled(*args))
    out = compiled(*_generate._prepare(bundle, [prompt], method, new, 0.0, 0, 1.0, 0, [], {})[2])
    generate_rounds = int(out.rounds) - (1 if method == "ar" else 0)
    result = dict(generate=timeline(compiled.as_text(), events, generate_rounds, 1))
    loop, state = fresh_loop(bundle, method, prompt, new, 16)
    before = loop_iterations(state)
    drained = []
    events = gpu_timeline(lambda: drained.append(drain(loop, state, new)))
    state, _, calls = drained[0]
    advance = _generate.ar_advance if method == "ar" else spec_advance
    advance_hlo = [c for key, c in _generate._COMPILED.items() if key[0] is advance][-1].as_text()
    result["calls_of_16"] = timeline(advance_hlo, events, loop_iterations(state) - before, calls)
    if hlo_dir:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{method}_generate.hlo.txt").write_text(compiled.as_text())
        (hlo_dir / f"{method}_advance.hlo.txt").write_text(advance_hlo)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
