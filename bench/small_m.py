"""A candidate product for the few rows of a decode step, a tree verification or a drafter block (M <= 128),
measured by bench/gemm.py against XLA's (issue 39: slower at most shapes; not used by the library).

At these M a product is bound by reading the weight, not by its FLOPs: every column block of the
weight should be streamed once, by enough programs to keep every SM's loads in flight. One program
per (row block, `block_n` columns, K split): the row block is all M rows padded to a power of two
(>= 16, the tensor cores' smallest), K walks in `block_k` steps with Triton's software pipeline
(`num_stages` loads in flight); `split_k` > 1 gives each program 1/split_k of K and sums the float32
partials after (for weights with few columns, e.g. `down` / `o`).

The reference is the plain XLA product, equal up to rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from weaver_jax.pallas_kernels._call import pallas_call, pow2_at_least

MAX_BLOCK_M = 128


def matmul_reference(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, steps: int):
    """x_ref `[block_m, K]` (the row block), w_ref `[K, block_n]`, o_ref `[1, block_m, block_n]`; K from
    split program_id(2) * steps * block_k."""
    start = pl.program_id(2) * steps

    def step(i, acc):
        depth = pl.ds((start + i) * block_k, block_k)
        return acc + plgpu.dot(x_ref[:, depth], w_ref[depth, :])

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape[1:], jnp.float32))
    o_ref[0] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "split_k", "num_warps", "num_stages",
                                             "interpret", "poison"))
def matmul(x, w, *, block_n: int = 64, block_k: int = 128, split_k: int = 1, num_warps: int = 4,
           num_stages: int = 4, interpret: bool = False, poison: bool = False):
    """x `[..., K]` @ w `[K, N]` -> `[..., N]` in x's dtype (float32 accumulation). K must divide into
    `split_k * block_k` pieces and N into `block_n` (real models' widths do; anything else: an error)."""
    *lead, k = x.shape
    if w.shape[0] != k:
        raise ValueError(f"x has {k} columns but the weight has {w.shape[0]} rows")
    n = w.shape[1]
    if k % (split_k * block_k) or n % block_n:
        raise ValueError(f"weight {tuple(w.shape)} does not tile into K blocks of {block_k} x {split_k} splits "
                         f"and N blocks of {block_n}")
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    block_m = min(pow2_at_least(m, 16), MAX_BLOCK_M)
    m_pad = -(-m // block_m) * block_m
    rows = jnp.pad(rows, ((0, m_pad - m), (0, 0)))
    out_dtype = x.dtype if split_k == 1 else jnp.float32
    out = pallas_call(
        functools.partial(_kernel, block_k=block_k, steps=k // (split_k * block_k)), [rows, w],
        grid=(m_pad // block_m, n // block_n, split_k),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0)),
                  pl.BlockSpec((k, block_n), lambda i, j, s: (0, j))],
        out_specs=pl.BlockSpec((1, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((split_k, m_pad, n), out_dtype),
        name="small_m_matmul", num_warps=num_warps, num_stages=num_stages, interpret=interpret, poison=poison)
    out = out[0] if split_k == 1 else out.sum(0).astype(x.dtype)
    return out[:m].reshape(*lead, n)
