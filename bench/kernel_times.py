"""Where a verification's time goes beside a decode step's: GPU time per kernel from a profiler trace.

    python bench/kernel_times.py --contexts 1024 16384 --nodes 1 64 --kernels on --json out.json
    python bench/kernel_times.py --shape qwen3.6-27b --nodes 1 --exact --json out.json    # exact mode's step

For each context, kernel setting and tree size (N = 1 is a decode step), `--steps` forwards of the
Qwen3-8B-shaped target (random weights) run in one `fori_loop` with the cache carried, as
bench/verify.py times them, under `jax.profiler.trace`; the trace's GPU events are summed per
kernel and per HLO op and divided by the steps. Rows: `kernel` (launch name), `op` (the HLO
instruction), `us` per forward, `calls` per forward; and per configuration the GPU's busy time and
the loop's wall time per forward (their difference: the gaps between kernels).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
import tempfile
import time
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.profiler import ProfileData

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode as bench  # noqa: E402
from verify import TINY, random_tree, verify_body  # noqa: E402

from weaver_jax.pallas_kernels import KERNELS, kernel_scope  # noqa: E402


class Event(typing.NamedTuple):
    kernel: str  # the launch's name
    op: str  # the HLO instruction it runs ("" when the trace does not say)
    us: float
    start_ns: int


def gpu_timeline(run) -> list[Event]:
    """Every event on the GPU's stream lines while `run()` runs, in start order."""
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir):
            jax.block_until_ready(run())
        trace = next(Path(logdir).rglob("*.xplane.pb"))
        data = ProfileData.from_serialized_xspace(trace.read_bytes())
    events, lines = [], []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            lines.append(line.name)
            if line.name.startswith("Stream"):  # the kernels as they ran (other lines are summaries)
                events += [Event(event.name, str(dict(event.stats).get("hlo_op", "")), event.duration_ns / 1e3,
                                 int(event.start_ns)) for event in line.events]
    if not events:
        print(f"no kernel events on the GPU's stream lines; lines: {lines}", file=sys.stderr)
    return sorted(events, key=lambda e: e.start_ns)


def gpu_events(run) -> list[tuple[str, str, float]]:
    """(kernel name, HLO op, microseconds) of every event on the GPU's stream lines while `run()` runs."""
    return [(e.kernel, e.op, e.us) for e in gpu_timeline(run)]


def describe(hlo: str, name: str) -> str:
    """The optimized HLO's line for instruction `name` (a kernel is named after the fusion it runs,
    "." written "_") and the ROOT of the computation it calls, shortened: what the kernel computes."""
    line = re.search(rf"^\s*%?{re.escape(name).replace('_', '[._]')} = (.*)$", hlo, re.M)
    if line is None:
        return ""
    called = re.search(r"calls=%?([\w.\-]+)", line.group(1))
    root = called and re.search(rf"^%?{re.escape(called.group(1))} .*?^\s*ROOT (.*?)$", hlo, re.M | re.S)
    short = lambda text: re.sub(r", metadata=\{.*", "", text)[:160]  # noqa: E731
    return short(line.group(1)) + (" | ROOT " + short(root.group(1)) if root else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[*sorted(bench.SHAPES), "tiny"], default="qwen3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--kernels", choices=["off", "on"], nargs="+", default=["on"])
    parser.add_argument("--exact", action="store_true", help="exact mode's forward (issue 42: what its step "
                        "spends beyond the default one's)")
    parser.add_argument("--steps", type=int, default=20, help="forwards per traced loop")
    parser.add_argument("--top", type=int, default=25, help="rows kept per configuration (by time)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    config = TINY.replace(dtype=dtype) if args.shape == "tiny" else bench.SHAPES[args.shape](dtype)
    target = bench.random_target(config)
    graphdef, params = nnx.split(target)
    b, start = args.batch, jnp.zeros((args.batch,), jnp.int32)
    rows = []
    for context in args.contexts:
        size = -(-(context + max(args.nodes) + 1) // 128) * 128
        cache = target.init_cache(b, size).with_lengths(jnp.full((b,), context))  # (a hybrid's: GDN states too)
        for kernels in args.kernels:
            for n in args.nodes:
                with kernel_scope(KERNELS if kernels == "on" else ()):
                    body = verify_body(graphdef, random_tree(b, n, 15, config.vocab_size), config.vocab_size,
                                       exact=args.exact)
                    loop = jax.jit(lambda carry, ws, body=body: jax.lax.fori_loop(
                        0, args.steps, lambda _, c: body(c, ws), carry))
                    compiled = loop.lower((start, cache), params).compile()  # once: its HLO names the kernels
                    jax.block_until_ready(compiled((start, cache), params))  # warm-up
                    t0 = time.perf_counter()
                    jax.block_until_ready(compiled((start, cache), params))
                    wall = (time.perf_counter() - t0) / args.steps * 1e6
                    events = gpu_events(functools.partial(compiled, (start, cache), params))
                where = dict(context=context, kernels=kernels, nodes=n, exact=args.exact)
                total = collections.defaultdict(float)
                calls = collections.Counter()
                for name, op, us in events:
                    total[name, op] += us / args.steps
                    calls[name, op] += 1
                busy = float(np.sum(list(total.values())))
                rows.append(dict(where, busy_us=busy, wall_us=wall))
                print(json.dumps(rows[-1]), flush=True)
                for (name, op), us in sorted(total.items(), key=lambda kv: -kv[1])[: args.top]:
                    rows.append(dict(where, kernel=name[:120], op=op, us=us, calls=calls[name, op] / args.steps,
                                     hlo=describe(compiled.as_text(), name)))
                    print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
