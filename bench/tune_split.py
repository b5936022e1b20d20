"""Where `weaver-jax tune`'s time goes (issue 41, goal 4: <= 60 s): each program's tracing and lowering (Python,
under the GIL: programs compiled at once serialize there) and XLA compile (outside it), beside tune's own figures.

    python bench/tune_split.py --json out.json                          # tune's default cells: B 1, 8 x T 0, 1
    python bench/tune_split.py --compiler-options '{"xla_gpu_autotune_level": 0}' --json out.json
    python bench/tune_split.py --batch 1 --temperature 0                # one cell (a CPU check)

A random target of SmolLM2's shape with the shipped drafter and adapter (no GGUF needed; a round's time does not
depend on the weights' values) and a fresh cost file. `--compiler-options` apply to every program, as
`_generate.COMPILER_OPTIONS` (one setting per process: jax and XLA keep programs and autotuning results per
process); the round times show what a setting costs at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import round_profile  # noqa: E402

from weaver_jax import _auto, _generate  # noqa: E402


def covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of the intervals was under way."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-target", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--compiler-options", type=json.loads, default={},
                        help='XLA options for every program (_generate.COMPILER_OPTIONS), as JSON')
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ["WEAVER_JAX_CACHE"] = tempfile.mkdtemp()  # a fresh cost file: every tier timed
    _generate.COMPILER_OPTIONS.update(ar=args.compiler_options, spec=args.compiler_options)
    bundle = round_profile.bundle_for(argparse.Namespace(
        random_target=args.random_target, dtype=None, drafter=None, adapter=None, drafter_layers=0, adapter_shape={}))
    _generate.COMPILE_PHASES.clear()
    t0 = time.perf_counter()
    cells = _auto.tune(bundle, batch_sizes=args.batch, temperatures=args.temperature)
    seconds = time.perf_counter() - t0
    phases = list(_generate.COMPILE_PHASES)
    python = covered([(a, c) for _, a, _, c, _ in phases])  # tracing and lowering: Python, under the GIL
    xla = covered([(c, d) for _, _, _, c, d in phases])
    programs = [(name, round(b - a, 2), round(c - b, 2), round(d - c, 2)) for name, a, b, c, d in phases]
    for cell in cells:
        print(f"B = {cell['batch']}, T = {cell['temperature']:g}: round ms {cell['round_ms']}, "
              f"compile {cell['compile_seconds']}")
    print(f"tune {seconds:.1f} s; while some of its {len(programs)} programs were tracing or lowering (Python): "
          f"{python:.1f} s, compiling in XLA: {xla:.1f} s; each program's (trace, lower, compile) s: {programs}",
          flush=True)
    if args.json:
        args.json.write_text(json.dumps([dict(seconds=round(seconds, 1), python_seconds=round(python, 1),
                                              xla_seconds=round(xla, 1), programs=programs,
                                              cells=cells, compiler_options=args.compiler_options,
                                              device=jax.devices()[0].device_kind, jax=jax.__version__)], indent=1))


if __name__ == "__main__":
    main()
