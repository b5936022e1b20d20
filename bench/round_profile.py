"""Where a round's time goes: GPU time and kernel launches per stage of one `generate` call.

    python bench/round_profile.py --model SmolLM2.gguf --drafter D --adapter A --config ar dflash weaver:budget=64
    python bench/round_profile.py --random-target smollm2-135m --config ar weaver:budget=64   # no GGUF needed

For each configuration, one `generate` call (batch `--batch`, one prompt repeated, EOS off,
`--max-new-tokens`) runs under `jax.profiler.trace`, compiled first. Every GPU kernel of the trace is
attributed to a stage by the named scope of the HLO instruction it runs (`_speculative._round`: drafter,
tree, verify, accept, drafter_commit; the rest of the loop body is "loop"; outside the loop, "prefill").
Rows per stage: GPU busy microseconds and kernels per round (a round of "ar" is a decode step), and per
configuration the wall time per round: wall minus the busy sum is the time the GPU waited on the host.
`net_us_per_round` leaves the prefill out: the call's wall less that of the same prompts through `ar`
with one new token (the prefill alone), per round - a round's cost against `ar`'s step without the
prefill's share of a short call. `--wall-only` skips the profiled call (walls only, faster);
`--temperature` times sampled rounds. Rows are written to `--json` as they come.
`--mesh DxM` runs every configuration on a (data, model) mesh of D x M devices (issue 38; a random target is
drawn straight into its shards). `--random-target` replaces the GGUF target by random weights of that shape
(speed does not depend on weight values with EOS off) beside the shipped SmolLM2 drafter and adapter (with a
larger shape: a random drafter and adapter of bench/verify.py's shapes, 5 layers and rank 1024;
`--drafter-layers N`: a random drafter of N layers instead, to price a deeper one; `--adapter-shape '{"d_rank":
384, "num_heads": 6}'`: a random adapter with these fields of its config changed, to price a wider one).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import importlib
import itertools
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode as bench  # noqa: E402
from e2e import parse_config  # noqa: E402
from kernel_times import gpu_events  # noqa: E402
from verify import random_pair  # noqa: E402

import weaver_jax as wj  # noqa: E402
from weaver_jax import _generate, _load, _sharding, cli  # noqa: E402
from weaver_jax._adapter import Adapter  # noqa: E402
from weaver_jax._drafter import Drafter  # noqa: E402
from weaver_jax.pallas_kernels import kernel_scope  # noqa: E402

STAGES = ("drafter", "tree", "verify", "accept", "drafter_commit")
SUBSTAGES = ("pool", "prefix", "node_step", "children")  # inside "tree" (Weaver's); the rest there is the search


def _key(name: str) -> str:
    """A kernel's name as its HLO instruction's: XLA writes "." and "-" as "_"; a Pallas kernel is
    named after its `pallas_call` (`weaver_expand`), with a "__N" suffix per copy."""
    return re.sub(r"__\d+$", "", re.sub(r"[.\-]", "_", name))


def _stage(op_name: str) -> str:
    parts = op_name.split("/")
    scoped = [p for p in parts if p in STAGES]
    stage = scoped[0] if scoped else ("loop" if "while" in parts else "prefill")
    if stage == "tree":
        sub = [p for p in parts if p in SUBSTAGES]
        stage += "/" + (sub[-1] if sub else "search")
    return stage


def op_stages(hlo: str) -> dict[str, str]:
    """Kernel name (`_key`) -> the stage its HLO instruction's op_name metadata names (a named scope
    of the round, with the innermost sub-stage of the tree: "tree/node_step"). Inside the loop's
    command buffers (CUDA graphs) the profiler names kernels, not instructions: fusions by their
    instruction, Pallas kernels by the name in their custom call's config; an instruction without
    metadata counts for the loop or the prefill by the computation it sits in."""
    stages = {}
    computation = ""
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
            continue
        instruction = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if not instruction:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        stage = _stage(op_name.group(1)) if op_name else ("loop" if "body" in computation else "prefill")
        stages[_key(instruction.group(1))] = stage
        pallas = re.search(r'\\?"name\\?":\s*\\?"([\w.\-]+)\\?"', line) if "triton" in line else None
        if pallas and op_name:
            stages.setdefault(_key(pallas.group(1)), stage)
    return stages


def bundle_for(args) -> wj.Bundle:
    """The bundle `args` name; with `args.mesh` ("DxM") on that mesh as `weaver_jax.shard` places it (a random
    target larger than SmolLM2's drawn straight into its shards: a 70B target is never whole on one device)."""
    mesh = cli._mesh(getattr(args, "mesh", None))
    if not args.random_target:
        bundle = wj.load(args.model, dtype=args.dtype, drafter=args.drafter, adapter=args.adapter)
        return bundle if mesh is None else wj.shard(bundle, mesh)
    config = bench.SHAPES[args.random_target](args.dtype or "bfloat16")
    if args.random_target != "smollm2-135m":  # the shipped pair does not fit: bench/verify.py's random shapes
        drafter, adapter = random_pair(config, drafter_layers=args.drafter_layers or 5, mesh=mesh)
        return wj.Bundle(bench.random_target(config, mesh), drafter=drafter, adapter=adapter,
                         mesh=mesh and _sharding.auto_mesh(mesh))
    target = bench.random_target(config)
    shipped = _load.SHIPPED_WEIGHTS / "smollm2-135m-instruct"
    part = lambda kind: _load._load_part(Path(getattr(args, kind) or shipped / kind), kind, config.dtype, config)  # noqa: E731
    drafter = part("drafter")
    if args.drafter_layers:  # a random drafter of another depth, to price it before training one
        drafter = Drafter(dataclasses.replace(drafter.config, num_layers=args.drafter_layers), rngs=nnx.Rngs(0))
    adapter = part("adapter")
    if args.adapter_shape:  # a random adapter of another shape, to price it before training one
        adapter = Adapter(dataclasses.replace(adapter.config, **args.adapter_shape), rngs=nnx.Rngs(0))
    bundle = wj.Bundle(target, drafter=drafter, adapter=adapter)
    return bundle if mesh is None else wj.shard(bundle, mesh)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--random-target", choices=sorted(bench.SHAPES))
    parser.add_argument("--drafter")
    parser.add_argument("--adapter")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--drafter-layers", type=int, default=0,
                        help="with --random-target: a random drafter of this many layers (the shipped one's shape)")
    parser.add_argument("--adapter-shape", type=json.loads, default={},
                        help='with --random-target: a random adapter, these AdapterConfig fields changed')
    parser.add_argument("--config", nargs="+", default=["ar", "dflash", "ddtree:budget=64", "weaver:budget=64"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--wall-only", action="store_true", help="no profiled call: wall times per round only")
    parser.add_argument("--kernel-options", type=json.loads, default={},
                        help='launch options per Pallas kernel, e.g. \'{"weaver_search": {"num_warps": 8}}\'')
    parser.add_argument("--spec-compiler-options", type=json.loads, nargs="+", default=[{}],
                        help='XLA option sets for the speculative programs, each in turn (_generate.COMPILER_OPTIONS), '
                             'e.g. \'{}\' \'{"xla_gpu_enable_triton_gemm": false}\'')
    parser.add_argument("--mesh", help="DATAxMODEL: the bundle over that many devices (issue 38), e.g. 1x2")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--hlo-dir", type=Path, help="write each configuration's optimized HLO there")
    args = parser.parse_args()
    for name, options in args.kernel_options.items():  # callers look each kernel up in its module when traced
        module = importlib.import_module(f"weaver_jax.pallas_kernels.{name}")
        setattr(module, name, functools.partial(getattr(module, name), **options))
    bundle = bundle_for(args)
    prompt = np.random.default_rng(0).integers(0, bundle.config.vocab_size, args.prompt_length).tolist()

    def prepare(method, options, max_new_tokens):  # the caches are donated: new arguments for every call
        method_options = {k: v for k, v in options.items() if k != "exact"}
        return _generate._prepare(bundle, [prompt] * args.batch, method, max_new_tokens, args.temperature, 0, 1.0, 0,
                                  [], method_options, exact=options.get("exact", False))

    def timed(fresh):  # fresh() -> (fn, static, args): compiled, warmed up, then one timed call
        fn, static, call_args = fresh()
        with _generate._mesh_scope(bundle):
            compiled = _generate._compiled(fn, static, *call_args)
        jax.block_until_ready(compiled(*call_args))
        call_args = fresh()[2]
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*call_args))
        return compiled, out, time.perf_counter() - t0

    prefill = timed(functools.partial(prepare, "ar", {}, 1))[2]
    print(json.dumps(dict(prefill_ms=prefill * 1e3, batch=args.batch, prompt_length=args.prompt_length)), flush=True)
    rows = []
    for config, xla_options in itertools.product(args.config, args.spec_compiler_options):
        method, options, kernels = parse_config(config)
        if method == "ar" and xla_options != args.spec_compiler_options[0]:
            continue
        _generate.COMPILER_OPTIONS["spec"] = xla_options
        fresh = functools.partial(prepare, method, options, args.max_new_tokens)
        with contextlib.nullcontext() if kernels is None else kernel_scope(kernels):  # read when traced
            compiled, out, wall = timed(fresh)
        rounds = int(out.rounds) - (1 if method == "ar" else 0)  # loop iterations (ar counts its prefill)
        row = dict(config=config, spec_compiler_options=xla_options, batch=args.batch, temperature=args.temperature,
                   prompt_length=args.prompt_length, rounds=rounds, wall_us_per_round=wall / rounds * 1e6,
                   net_us_per_round=(wall - prefill) / rounds * 1e6,
                   tokens_per_round=(float(jnp.mean(out.num_tokens)) - 1) / rounds,  # the prefill's token aside
                   kernel_options=args.kernel_options, mesh=args.mesh, device=jax.devices()[0].device_kind,
                   target="random " + args.random_target if args.random_target else args.model)
        if not args.wall_only:
            row.update(profile(compiled, fresh, rounds, args.hlo_dir and args.hlo_dir / re.sub(r"\W", "_", config)))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


def profile(compiled, fresh, rounds: int, hlo_path: Path | None) -> dict:
    """One profiled call: GPU busy time and kernels per round and stage, and the costliest kernels."""
    hlo = compiled.as_text()
    stages = op_stages(hlo)
    if hlo_path:
        hlo_path.parent.mkdir(parents=True, exist_ok=True)
        hlo_path.with_suffix(".hlo.txt").write_text(hlo)
    busy, kernels = collections.defaultdict(float), collections.Counter()
    events = gpu_events(functools.partial(compiled, *fresh()[2]))
    unknown, by_kernel = collections.Counter(), collections.defaultdict(lambda: [0, 0.0])
    for kernel, op, us in events:
        stage = stages.get(_key(op)) or stages.get(_key(kernel)) or "unattributed"
        if stage == "unattributed":
            unknown[kernel, op] += 1
        busy[stage] += us
        kernels[stage] += 1
        name = _key(kernel if not op or op.startswith("command_buffer") else op)  # inside a graph: the kernel's
        by_kernel[stage, name[:120]][0] += 1
        by_kernel[stage, name[:120]][1] += us
    if unknown:
        print("unattributed (kernel, HLO op), most frequent:", unknown.most_common(8), flush=True)
    per_round = {s: busy[s] / rounds for s in busy if s != "prefill"}
    return dict(busy_us_per_round=sum(per_round.values()),
                kernels_per_round=sum(kernels[s] for s in kernels if s != "prefill") / rounds,
                stages={s: dict(us=busy[s] / rounds, kernels=kernels[s] / rounds) for s in sorted(busy)},
                top_kernels=[(stage, name, n / rounds, us / rounds) for (stage, name), (n, us)
                             in sorted(by_kernel.items(), key=lambda item: -item[1][1])[:80] if stage != "prefill"])


if __name__ == "__main__":
    main()
