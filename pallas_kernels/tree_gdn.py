"""Tree verification of a Gated DeltaNet layer in one Pallas (Triton) program per (sequence, value
head, `block_v` value columns): every node's output along its own root-to-node path from the
committed state, with no per-node state written (`weaver_jax._gdn` has the algebra;
`gated_delta_tree` is the reference).

Nodes come in tree order (a node's ancestors before it), so the system below is lower triangular;
the program walks the T nodes in blocks of 16 (loops, not unrolled), every tile 16 x 16 or 16 x d:
  prefix = ancestors-or-self @ g; ratio_ij = exp(prefix_i - prefix_j) on i's path, else 0;
  A = beta_i ratio_ij (k_i . k_j) over strict ancestors; rhs = beta (v - exp(prefix) k S0);
  (I + A) u = rhs by blocks: u_r = (I + A_rr)^-1 (rhs_r - sum_{c<r} A_rc u_c), the 16 x 16 inverse
  by X <- I - A_rr X 15 times (exact: A_rr is strictly lower; stable as forward substitution is:
  the product (I - N)(I + N^2)(I + N^4)(I + N^8), also exact, lost 3e-4 on deep chains);
  out = exp(prefix) q S0 + (ratio * q k^T) u.
Each block's prefix and u go to the outputs and are read back from there by later blocks (a barrier
between: other threads of the program wrote them), so registers hold one block pair at a time: the
whole-tree form (T x T tiles; unrolled block lists) spilled to local memory and ran 10-100x slower
than XLA. The solve's columns are independent, so value columns split across programs (more programs
at batch 1, a smaller state tile each). Outputs: out `[B, T, H_v, d_v]` float32, and u
`[B, H_v, T, d_v]`, prefix `[B, H_v, T]` for `fold`.

Products: float32 operands on tensor cores, at the precision of JAX's matmuls in scope (as XLA's own
float32 products on a GPU): single-pass TF32 by default (as `jax.lax.Precision.DEFAULT` there), three
TF32 passes (`TF32_TF32_F32_X3`, about float32's accuracy; 6-23x slower on the H200) under "highest" /
"float32" (`jax.default_matmul_precision`); "ieee" (float32 on the FMA path: whole K = 128 rows per
thread, it spilled) only when asked. In interpret mode (CPU) at full float32.

Shapes: q, k `[B, T, H_k, d_k]` (L2-normalised, q scaled), v `[B, T, H_v, d_v]`, g, beta `[B, T, H_v]`,
state `[B, H_v, d_k, d_v]` float32, ancestors `[B, T, T]` bool (ancestors-or-self, each ancestor
before its node); d_k, d_v powers of two >= 16; value head h reads key head h // (H_v / H_k).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from weaver_jax._gdn import gated_delta_tree
from weaver_jax.pallas_kernels._call import pallas_call

BLOCK = 16  # nodes per tile
PRECISIONS = {"tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3, "tf32": jax.lax.Precision.DEFAULT,
              "ieee": jax.lax.Precision.HIGHEST}


def default_precision() -> str:
    """The products' precision that matches JAX's matmul precision in scope (read when traced)."""
    return "tf32x3" if jax.config.jax_default_matmul_precision in ("highest", "float32") else "tf32"


def tree_gdn_reference(q, k, v, g, beta, state, ancestors):
    """-> (out, u, prefix) as the kernel returns them, from `weaver_jax._gdn.gated_delta_tree`."""
    out, terms = gated_delta_tree(q, k, v, g, beta, state, ancestors)
    return out, terms.u, terms.prefix


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, own_ref, out_ref, u_ref, prefix_ref, *, precision,
            barrier: bool):
    """One (sequence, value head, column block): q_ref, k_ref `[n, d_k]`, v_ref `[n, block_v]`, g_ref,
    beta_ref `[n]`, s_ref `[d_k, block_v]`, own_ref `[n, n]` int8 (ancestors-or-self); n = 16 x blocks.
    barrier: synchronise the program's threads after writing what later blocks read (not in interpret
    mode, which runs one thread)."""
    blocks = own_ref.shape[0] // BLOCK
    dot = functools.partial(plgpu.dot, precision=precision)
    rows = lambda r: pl.ds(pl.multiple_of(r * BLOCK, BLOCK), BLOCK)  # noqa: E731
    diagonal = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0) == jax.lax.broadcasted_iota(
        jnp.int32, (BLOCK, BLOCK), 1)
    eye = diagonal.astype(jnp.float32)

    def sync():
        if barrier:
            plgpu.debug_barrier()

    def prefix_block(r, _):
        prefix_ref[rows(r)] = jax.lax.fori_loop(0, r + 1, lambda c, acc: acc + jnp.sum(
            jnp.where(own_ref[rows(r), rows(c)] != 0, g_ref[rows(c)][None, :], 0.0), axis=1),
            jnp.zeros((BLOCK,), jnp.float32))
        return 0

    jax.lax.fori_loop(0, blocks, prefix_block, 0)
    sync()
    s = s_ref[...]

    def solve_block(r, _):
        q_r, k_r = q_ref[rows(r), :].astype(jnp.float32), k_ref[rows(r), :].astype(jnp.float32)
        prefix_r, beta_r = prefix_ref[rows(r)][:, None], beta_ref[rows(r)][:, None]

        def ratio(c):  # [16, 16]: exp(prefix_i - prefix_j) where node j of block c is on i's path
            return jnp.where(own_ref[rows(r), rows(c)] != 0,
                             jnp.exp(jnp.minimum(prefix_r - prefix_ref[rows(c)][None, :], 0.0)), 0.0)

        def earlier(c, carry):  # block c < r: its solved u into r's right-hand side and output
            rhs, out = carry
            k_c, u_c, ratio_c = k_ref[rows(c), :].astype(jnp.float32), u_ref[rows(c), :], ratio(c)
            return (rhs - dot(beta_r * ratio_c * dot(k_r, k_c, trans_b=True), u_c),
                    out + dot(ratio_c * dot(q_r, k_c, trans_b=True), u_c))

        decay = jnp.exp(prefix_r)
        rhs, out = jax.lax.fori_loop(0, r, earlier, (
            beta_r * (v_ref[rows(r), :].astype(jnp.float32) - decay * dot(k_r, s)), decay * dot(q_r, s)))
        ratio_r = ratio(r)
        within = jnp.where(diagonal, 0.0, beta_r * ratio_r * dot(k_r, k_r, trans_b=True))
        inverse = jax.lax.fori_loop(0, BLOCK - 1, lambda _, x: eye - dot(within, x), eye)
        u_r = dot(inverse, rhs)
        u_ref[rows(r), :] = u_r
        out_ref[rows(r), :] = out + dot(ratio_r * dot(q_r, k_r, trans_b=True), u_r)
        sync()
        return 0

    jax.lax.fori_loop(0, blocks, solve_block, 0)


@functools.partial(jax.jit, static_argnames=("block_v", "precision", "interpret", "poison"))
def tree_gdn(q, k, v, g, beta, state, ancestors, *, block_v: int = 64, precision: str | None = None,
             interpret: bool = False, poison: bool = False):
    """The tree's GDN outputs and fold terms (module docstring). block_v: value columns per program
    (a power of two >= 16; at most d_v); precision: the products' (`PRECISIONS`; None: `default_precision()`;
    ignored in interpret mode). poison (tests): outputs start as NaN."""
    precision = default_precision() if precision is None else precision
    b, t, h_k, d_k = q.shape
    h_v, d_v = v.shape[2], v.shape[3]
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {list(PRECISIONS)}")
    if h_v % h_k:
        raise ValueError(f"{h_v} value heads do not share {h_k} key heads evenly")
    for name, d in (("d_k", d_k), ("d_v", d_v), ("block_v", block_v)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{name} = {d} must be a power of two >= 16")
    block_v = min(block_v, d_v)
    n = -(-t // BLOCK) * BLOCK  # padded nodes: their own rows only, beta 0: they write and read nothing
    pad = n - t

    def nodes(x):  # node axis 1 -> padded, heads first: [B, H, n, ...]
        return jnp.moveaxis(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)), 2, 1)

    own = jnp.pad(ancestors, [(0, 0), (0, pad), (0, pad)]) | (jnp.eye(n, dtype=bool) & (jnp.arange(n) >= t))
    repeat = h_v // h_k
    key_head = lambda i, j, c: (i, j // repeat, 0, 0)  # noqa: E731
    columns = lambda i, j, c: (i, j, 0, c)  # noqa: E731
    head = lambda i, j, c: (i, j, 0)  # noqa: E731
    out, u, prefix = pallas_call(
        functools.partial(_kernel, precision=PRECISIONS["ieee" if interpret else precision], barrier=not interpret),
        [nodes(q), nodes(k), nodes(v), nodes(g.astype(jnp.float32)), nodes(beta.astype(jnp.float32)),
         state.astype(jnp.float32), own.astype(jnp.int8)],
        grid=(b, h_v, d_v // block_v),
        in_specs=[pl.BlockSpec((None, None, n, d_k), key_head), pl.BlockSpec((None, None, n, d_k), key_head),
                  pl.BlockSpec((None, None, n, block_v), columns), pl.BlockSpec((None, None, n), head),
                  pl.BlockSpec((None, None, n), head), pl.BlockSpec((None, None, d_k, block_v), columns),
                  pl.BlockSpec((None, n, n), lambda i, j, c: (i, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, n, block_v), columns), pl.BlockSpec((None, None, n, block_v), columns),
                   pl.BlockSpec((None, None, n), head)],  # every column block writes the same prefix
        out_shape=[jax.ShapeDtypeStruct((b, h_v, n, d_v), jnp.float32),
                   jax.ShapeDtypeStruct((b, h_v, n, d_v), jnp.float32),
                   jax.ShapeDtypeStruct((b, h_v, n), jnp.float32)],
        name="tree_gdn", num_warps=4, num_stages=1, interpret=interpret, poison=poison)
    return jnp.moveaxis(out[:, :, :t], 1, 2), u[:, :, :t], prefix[:, :, :t]
