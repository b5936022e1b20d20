"""What a chunked-loop call costs besides its rounds (streaming and the server run a few rounds per call):
per-call time at 1 and 16 rounds a call against a decode step inside `generate`, one sequence.

    python bench/call_cost.py --json out.json
    XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN python bench/call_cost.py

A random target of SmolLM2's shape with the shipped drafter and adapter (no GGUF needed), 96-token prompt, EOS off,
`ar` and Weaver's defaults, through `_stream.Loop` as `Run` calls it (the halted rows and the rounds uploaded
once); each figure the mean over the calls of one sequence after an untimed one. fixed_ms = per-call time at 1
round less one round's time inside `generate`; a call of 0 rounds is the dispatch alone (no loop body runs, so no
command buffer is updated). Run it under XLA_FLAGS variants to find where the fixed cost goes (measured
2026-12-04 on an H200: a 0-round call 1.5 ms for `ar`, 2.3 for Weaver, no cheaper under any XLA flag tried,
command buffers off included: the host's dispatch; BENCHMARKS, issue 40's third pass).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import round_profile  # noqa: E402

import weaver_jax as wj  # noqa: E402
from weaver_jax import _generate, _stream  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-target", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--compiler-options", type=json.loads, default={},
                        help='XLA options for every program (_generate.COMPILER_OPTIONS), as JSON')
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
            state, window = loop._advance(state, loop.keys, loop._halt(halted), loop._rounds(np.int32(0)),
                                          loop._leave(np.bool_(False)))
            np.asarray(window)
        row["call_ms_at_0_rounds"] = (time.perf_counter() - t0) / 20 * 1e3
        for rounds in (1, 16):
            for _ in range(2):  # the first compiles
                _, static, loop_args = _generate._prepare(bundle, [prompt], method, new, 0.0, 0, 1.0, 0, [], {})
                loop = _stream.Loop(bundle, method, static, loop_args, rounds_per_call=rounds)
                state, calls, got = loop.start(loop_args), 0, []
                np.asarray(state.tokens)
                t0 = time.perf_counter()
                while len(got) < new - 1:  # the prefill made the first token
                    state, window = loop.advance(state, loop.keys, np.zeros((1,), bool))
                    got += [int(t) for t in window[0] if t >= 0]
                    calls += 1
                seconds = time.perf_counter() - t0
            row[f"call_ms_at_{rounds}_rounds"] = seconds / calls * 1e3
            row[f"same_tokens_as_generate_at_{rounds}_rounds"] = got == out.tokens[0][1:]  # a flag must not change them
        row["fixed_ms"] = row["call_ms_at_1_rounds"] - round_ms
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
