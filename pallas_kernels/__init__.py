"""Pallas (Triton backend) kernels, installed as `weaver_jax.pallas_kernels`.

Each kernel lives beside its pure-JAX reference and wrapper in one module:
  tree_attention: verification's attention of N tree nodes over the committed prefix (split
    across programs, grouped query heads sharing K/V loads) plus the tree's own K/V under the
    ancestor mask. Used by the target's forward when kernels are on.
  accept_commit: the acceptance walk over per-node target choices and the move of the accepted
    nodes' K/V into place, in place on the cache (two kernels: walk + gather, scatter). Used by
    every speculative round when kernels are on.
  adapter_attention: the Weaver adapter's node attention over the prefix and the node's ancestors,
    gathered by slot (`visible_slots`) instead of masking the whole tree. Used by the adapter's
    node steps when kernels are on and the search runs in XLA.
  weaver_search: the Weaver tree search, two kernels per adapter call (select + node step through
    every adapter block; pool scoring + publishing children) instead of ~50 XLA kernels, for adapters
    one program can hold (`weaver_search.fits`).
  row_invariant: exact mode's matrix product and attention, whose value for a row does not depend on
    the other rows. Used by the target's forward with `exact=True`, whatever the selection below.
  tree_gdn: a Gated DeltaNet layer's tree verification (every node along its own path, no per-node
    state) for hybrid targets. Used by their GDN layers when selected (measured on the H200 at 65 nodes:
    1.66x XLA's form at batch 1, 1.84x at 8; products in TF32 as XLA's own at the default precision).
  attention_from_qkv: tree_attention taking the fused qkv product's output, with the q / k norms, the
    rotation and both cache writes inside its kernel. Used by dense targets' decode steps and forwards of up to
    16 new tokens (the chain's verification, the drafter's block), per device under a sharded bundle's mesh
    (with tree_attention; measured faster there, slower for 32- and 64-node trees).

One switch selects kernels: `use_kernels(True | False | None)`, or the environment variable
`WEAVER_JAX_KERNELS=1 | 0`, turns all of them on or off (a comma-separated list of names: those). By
default, where jax's backend is a GPU, the kernels measured faster than XLA there (`MEASURED`, see
BENCHMARKS.md) are on, and none elsewhere; forced on a CPU they run in Pallas interpret mode (tests).
The selection is read when a function is traced: `generate` passes `enabled_kernels()` to the jitted
`ar_generate` / `spec_generate` as their static `kernels` argument, so a change takes effect at the next
call; other jitted code sees the selection it was first traced with.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.experimental.pallas.fuser  # noqa: F401  (up front, below)
import jax.numpy as jnp

# Pallas's fuser is imported up front: importing it adds a flag to jax's trace context, and jax imports it lazily
# while lowering a kernel, so inside a trace it changed the context between a jitted function's first call and its
# second, which then traced and compiled it again (exact `ar_generate`: each program compiled twice).

# A masked attention score: finite, so exp(MASKED_SCORE - m) is 0 without NaNs (shared by the kernels)
MASKED_SCORE = 0.7 * float(jnp.finfo(jnp.float32).min)
KERNELS = ("tree_attention", "accept_commit", "adapter_attention", "weaver_search", "tree_gdn", "attention_from_qkv")
# on by default on GPUs: each measured faster than XLA there (BENCHMARKS.md); weaver_search measured slower
MEASURED = ("tree_attention", "accept_commit", "adapter_attention", "tree_gdn", "attention_from_qkv")
_forced: bool | None = None
_scoped: list[tuple[str, ...]] = []


def use_kernels(on: bool | None) -> None:
    """Force every Pallas kernel on or off (None: back to the environment / default)."""
    global _forced
    _forced = on


@contextlib.contextmanager
def kernel_scope(kernels: tuple[str, ...]):
    """Inside: `enabled_kernels()` is `kernels` (the jitted generators trace their body in one)."""
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; available: {list(KERNELS)}")
    _scoped.append(tuple(kernels))
    try:
        yield
    finally:
        _scoped.pop()


def enabled_kernels() -> tuple[str, ...]:
    if _scoped:
        return _scoped[-1]
    if _forced is not None:
        return KERNELS if _forced else ()
    flag = os.environ.get("WEAVER_JAX_KERNELS", "")
    if flag in ("0", "1"):
        return KERNELS if flag == "1" else ()
    if flag:
        names = tuple(name.strip() for name in flag.split(","))
        if set(names) - set(KERNELS):
            raise ValueError(f"WEAVER_JAX_KERNELS must be 0, 1 or a comma-separated list of {list(KERNELS)}, "
                             f"got {flag!r}")
        return names
    return MEASURED if jax.default_backend() == "gpu" else ()


def kernels_enabled(name: str) -> bool:
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; available: {list(KERNELS)}")
    return name in enabled_kernels()


def interpret() -> bool:
    """Interpret mode wherever Triton cannot run (CPU)."""
    return jax.default_backend() != "gpu"
