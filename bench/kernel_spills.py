"""Registers and spills of the tree-GDN Pallas kernel without a GPU: its Triton IR as jax lowers it for an
H200 (`tests/cuda.py`), compiled for sm_90a by the `triton` wheel, assembled by that wheel's `ptxas -v`.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install triton      # anywhere; not a weaver_jax dependency
    python bench/kernel_spills.py --triton-python /tmp/tv/bin/python --nodes 17 65 129 --precision tf32x3 tf32

The wheel's Triton is not the one inside jaxlib, so the figures are indicative; but a kernel whose ptxas
report shows a stack frame of kilobytes (spills to local memory) ran 10-100x slower than XLA on the H200
(BENCHMARKS, issue 20), and this finds it in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid import random_inputs  # noqa: E402

from tests.cuda import lower_with_triton_modules  # noqa: E402
from weaver_jax._hybrid import qwen3_6_27b  # noqa: E402
from weaver_jax.pallas_kernels.tree_gdn import PRECISIONS, tree_gdn  # noqa: E402

# Run by the wheel's Python: compile one Triton IR file, print the ptxas report's numbers as JSON.
COMPILE = r"""
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
path, warps = sys.argv[1], int(sys.argv[2])
kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
ptx = path + ".ptx"
open(ptx, "w").write(kernel.asm["ptx"])
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the PTX version this Triton writes
    report = subprocess.run([os.path.join(bin_dir, name), "-v", "--gpu-name", "sm_90a", ptx, "-o", path + ".cubin"],
                            capture_output=True, text=True)
    if report.returncode == 0:
        break
else:
    sys.exit(report.stderr)
numbers = lambda pattern: [int(x) for x in re.findall(pattern, report.stderr)]
print(json.dumps(dict(registers=numbers(r"Used (\d+) registers")[0], stack_bytes=numbers(r"(\d+) bytes stack frame")[0],
                      spill_store_bytes=numbers(r"(\d+) bytes spill stores")[0],
                      spill_load_bytes=numbers(r"(\d+) bytes spill loads")[0], shared_bytes=kernel.metadata.shared,
                      ptx_lines=kernel.asm["ptx"].count("\n"))))
"""


def tree_gdn_modules(nodes: int, precision: str, block_v: int) -> list[str]:
    """The Triton IR of tree_gdn's kernels (the system, then the solve) at Qwen3.6-27B's GDN heads
    (bench/hybrid.py's inputs), B = 1."""
    args = jax.eval_shape(lambda: random_inputs(qwen3_6_27b(), 1, nodes))
    return lower_with_triton_modules(tree_gdn, *args, precision=precision, block_v=block_v)[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton-python", required=True, help="a Python with the triton wheel installed")
    parser.add_argument("--nodes", type=int, nargs="+", default=[17, 65, 129])
    parser.add_argument("--precision", nargs="+", choices=sorted(PRECISIONS), default=["tf32x3"])
    parser.add_argument("--block-v", type=int, nargs="+", default=[32])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nodes, precision, block_v in itertools.product(args.nodes, args.precision, args.block_v):
            for kernel, module in zip(("system", "solve"), tree_gdn_modules(nodes, precision, block_v), strict=True):
                path = Path(tmp) / f"tree_gdn_{kernel}_{nodes}_{precision}_{block_v}.ttir"
                path.write_text(module)
                for warps in args.warps:
                    out = subprocess.run([args.triton_python, "-c", COMPILE, str(path), str(warps)],
                                         capture_output=True, text=True)
                    if out.returncode:
                        raise SystemExit(f"compiling {path.name} failed:\n{out.stderr[-2000:]}")
                    rows.append(dict(kernel=f"tree_gdn_{kernel}", nodes=nodes, precision=precision, block_v=block_v,
                                     warps=warps, **json.loads(out.stdout.strip().splitlines()[-1])))
                    print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
