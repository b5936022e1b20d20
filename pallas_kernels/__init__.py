"""Pallas (Triton backend) kernels, installed as `weaver_jax.pallas_kernels`.

Each kernel lives beside its pure-JAX reference and wrapper in one module:
  tree_attention: verification's attention of N tree nodes over the committed prefix (split
    across programs, grouped query heads sharing K/V loads) plus the tree's own K/V under the
    ancestor mask. Used by the target's forward when kernels are on.
  accept_commit: the acceptance walk over per-node target choices and the move of the accepted
    nodes' K/V into place, in place on the cache (two kernels: walk + gather, scatter). Used by
    every speculative round when kernels are on.

One switch selects kernels: `use_kernels(True | False | None)`, or the environment variable
`WEAVER_JAX_KERNELS=1 | 0`. By default they are on where jax's backend is a GPU (measured faster than
XLA there, BENCHMARKS.md) and off elsewhere; forced on a CPU they run in Pallas interpret mode (tests). The switch is read when a function is
traced: `generate` passes it to the jitted `ar_generate` / `spec_generate` as their static
`kernels` argument, so a change takes effect at the next call; other jitted code sees the value
it was first traced with.
"""

from __future__ import annotations

import contextlib
import os

import jax

_forced: bool | None = None
_scoped: list[bool] = []


def use_kernels(on: bool | None) -> None:
    """Force the Pallas kernels on or off (None: back to the environment / default)."""
    global _forced
    _forced = on


@contextlib.contextmanager
def kernel_scope(on: bool):
    """Inside: `kernels_enabled()` is `on` (the jitted generators trace their body in one)."""
    _scoped.append(on)
    try:
        yield
    finally:
        _scoped.pop()


def kernels_enabled() -> bool:
    if _scoped:
        return _scoped[-1]
    if _forced is not None:
        return _forced
    flag = os.environ.get("WEAVER_JAX_KERNELS", "")
    if flag in ("0", "1"):
        return flag == "1"
    if flag:
        raise ValueError(f"WEAVER_JAX_KERNELS must be 0 or 1, got {flag!r}")
    return jax.default_backend() == "gpu"


def interpret() -> bool:
    """Interpret mode wherever Triton cannot run (CPU)."""
    return jax.default_backend() != "gpu"
