"""Tree verification of a Gated DeltaNet layer in two Pallas (Triton) kernels: every node's output along
its own root-to-node path from the committed state, with no per-node state written (`weaver_jax._gdn`
has the algebra; `gated_delta_tree` is the reference).

Nodes come in tree order (a node's ancestors before it), so the system below is lower triangular:
  prefix = ancestors-or-self @ g; ratio_ij = exp(prefix_i - prefix_j) on i's path, else 0;
  A = beta_i ratio_ij (k_i . k_j) over strict ancestors; rhs = beta (v - exp(prefix) k S0);
  (I + A) u = rhs; out = exp(prefix) q S0 + (ratio * q k^T) u.
A round's latency is a chain of small dependent products, so the work is split by what depends on what:
- `_system_kernel`, one program per (sequence, value head, block of 16 nodes), all blocks at once: the
  block's prefix, its rows of A and of ratio * q k^T, and the inverse of its 16 x 16 diagonal block of
  I + A by doubling (three steps of two products; the 15-step iteration this replaced was half the
  layer's time).
- `_solve_kernel`, one program per (sequence, value head, `block_v` value columns): block by block,
  u_r = X_r (rhs_r - A_r,<r u_<r), one product with every earlier block's u (they are read back from the
  output behind a barrier: other threads wrote them); then every block's output, independent of the others.
The solve's columns are independent, so value columns split across programs (more programs at batch 1,
a smaller state tile each). Outputs: out `[B, T, H_v, d_v]` float32, and u `[B, H_v, T, d_v]`, prefix
`[B, H_v, T]` for `fold`.

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
from weaver_jax.pallas_kernels._call import pallas_call, pow2_at_least

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


def _system_kernel(q_ref, k_ref, g_ref, beta_ref, own_ref, prefix_ref, a_ref, p_ref, x_ref, *, precision):
    """One (sequence, value head, block r of 16 nodes): what the solve needs that no value column changes.
    q_ref, k_ref `[w, d_k]`, g_ref, beta_ref `[w]`, own_ref `[w, w]` int8 (ancestors-or-self); writes
    prefix_ref `[16]` (block r's), a_ref, p_ref `[16, w]` (block r's rows of A and of the outputs'
    ratio * q k^T, in blocks c <= r only) and x_ref `[16, 16]` = (I + A_rr)^-1."""
    r = pl.program_id(2)
    dot = functools.partial(plgpu.dot, precision=precision)
    rows = lambda c: pl.ds(pl.multiple_of(c * BLOCK, BLOCK), BLOCK)  # noqa: E731
    i = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)

    def prefix(c):  # [16]: block c's sums of g along each node's path
        return jnp.sum(jnp.where(own_ref[rows(c), :] != 0, g_ref[...][None, :], 0.0), axis=1)

    q_r, k_r, prefix_r = q_ref[rows(r), :].astype(jnp.float32), k_ref[rows(r), :].astype(jnp.float32), prefix(r)
    beta_r = beta_ref[rows(r)][:, None]
    prefix_ref[...] = prefix_r

    def block(c, strict):  # block c's A (strict ancestors) and ratio * q k^T (ancestors-or-self), [16, 16]
        own = own_ref[rows(r), rows(c)] != 0
        ratio = jnp.where(own, jnp.exp(jnp.minimum(prefix_r[:, None] - prefix(c)[None, :], 0.0)), 0.0)
        k_c = k_ref[rows(c), :].astype(jnp.float32)
        a = jnp.where(strict, beta_r * ratio * dot(k_r, k_c, trans_b=True), 0.0)
        a_ref[:, rows(c)], p_ref[:, rows(c)] = a, ratio * dot(q_r, k_c, trans_b=True)
        return a

    @pl.loop(0, r)
    def _(c):
        block(c, True)

    within = block(r, i > j)
    # (I + within)^-1 by doubling inverted diagonal blocks: with x the inverse of the diagonal blocks of size
    # s and l the entries below them in blocks of 2s, x - x l x inverts the blocks of 2s (exactly:
    # [[a, 0], [c, b]]^-1 = [[a^-1, 0], [-b^-1 c a^-1, b^-1]]); the blocks of 1 are ones.
    x = jnp.where(i == j, 1.0, jnp.where(i // 2 == j // 2, -within, 0.0))
    for s in (2, 4, 8):
        x = x - dot(x, dot(jnp.where((i // (2 * s) == j // (2 * s)) & (i // s != j // s), within, 0.0), x))
    x_ref[...] = x


def _solve_kernel(q_ref, k_ref, v_ref, beta_ref, s_ref, prefix_ref, a_ref, p_ref, x_ref, out_ref, u_ref, *,
                  blocks: int, precision, barrier: bool):
    """One (sequence, value head, column block): (I + A) u = rhs by blocks of 16 nodes, then the outputs.
    q_ref, k_ref `[w, d_k]`, v_ref `[w, block_v]`, beta_ref, prefix_ref `[w]`, s_ref `[d_k, block_v]`, a_ref,
    p_ref `[w, w]`, x_ref `[w, 16]` (`_system_kernel`'s); blocks: the node blocks written (w may be more).
    barrier: synchronise the program's threads after writing what later blocks read (not in interpret
    mode, which runs one thread)."""
    w = a_ref.shape[0]
    dot = functools.partial(plgpu.dot, precision=precision)
    rows = lambda r: pl.ds(pl.multiple_of(r * BLOCK, BLOCK), BLOCK)  # noqa: E731
    column = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, w), 1)
    node = jax.lax.broadcasted_iota(jnp.int32, (w, 1), 0)
    s = s_ref[...]

    def solve(r, _):  # u_r = X_r (rhs_r - A_r,<r u_<r): one product with every earlier block's u
        k_r, beta_r = k_ref[rows(r), :].astype(jnp.float32), beta_ref[rows(r)][:, None]
        earlier = jnp.where(node < r * BLOCK, u_ref[...], 0.0)  # rows not yet written may hold anything
        rhs = beta_r * (v_ref[rows(r), :].astype(jnp.float32) - jnp.exp(prefix_ref[rows(r)])[:, None] * dot(k_r, s))
        rhs = rhs - dot(jnp.where(column < r * BLOCK, a_ref[rows(r), :], 0.0), earlier)
        u_ref[rows(r), :] = dot(x_ref[rows(r), :], rhs)
        if barrier:
            plgpu.debug_barrier()
        return 0

    jax.lax.fori_loop(0, blocks, solve, 0)
    u = jnp.where(node < blocks * BLOCK, u_ref[...], 0.0)

    def output(r, _):  # exp(prefix) q S0 + (ratio * q k^T) u over the node's path
        decay = jnp.exp(prefix_ref[rows(r)])[:, None]
        out_ref[rows(r), :] = decay * dot(q_ref[rows(r), :].astype(jnp.float32), s) + dot(
            jnp.where(column < (r + 1) * BLOCK, p_ref[rows(r), :], 0.0), u)
        return 0

    jax.lax.fori_loop(0, blocks, output, 0)


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
    blocks = -(-t // BLOCK)  # node blocks; padded nodes own only themselves, beta 0: they write and read nothing
    w = pow2_at_least(blocks * BLOCK)  # the width of the products over every node (a power of two)
    pad = w - t

    def nodes(x):  # node axis 1 -> padded, heads first: [B, H, w, ...]
        return jnp.moveaxis(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)), 2, 1)

    own = jnp.pad(ancestors, [(0, 0), (0, pad), (0, pad)]) | (jnp.eye(w, dtype=bool) & (jnp.arange(w) >= t))
    q, k, v, beta = nodes(q), nodes(k), nodes(v), nodes(beta.astype(jnp.float32))
    precision = PRECISIONS["ieee" if interpret else precision]
    repeat = h_v // h_k
    key_head = pl.BlockSpec((None, None, w, d_k), lambda i, j, c: (i, j // repeat, 0, 0))
    head = pl.BlockSpec((None, None, w), lambda i, j, c: (i, j, 0))
    square = pl.BlockSpec((None, None, w, w), lambda i, j, c: (i, j, 0, 0))
    node_rows = lambda *shape: pl.BlockSpec((None, None, BLOCK, *shape), lambda i, j, r: (i, j, r, 0))  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct((b, h_v, *shape), jnp.float32)  # noqa: E731
    prefix, a, p, x = pallas_call(
        functools.partial(_system_kernel, precision=precision),
        [q, k, nodes(g.astype(jnp.float32)), beta, own.astype(jnp.int8)], grid=(b, h_v, blocks),
        in_specs=[key_head, key_head, head, head, pl.BlockSpec((None, w, w), lambda i, j, r: (i, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, BLOCK), lambda i, j, r: (i, j, r)), node_rows(w), node_rows(w),
                   node_rows(BLOCK)],
        out_shape=[f32(w), f32(w, w), f32(w, w), f32(w, BLOCK)],
        name="tree_gdn_system", num_warps=4, num_stages=1, interpret=interpret, poison=poison)
    columns = pl.BlockSpec((None, None, w, block_v), lambda i, j, c: (i, j, 0, c))
    state_columns = pl.BlockSpec((None, None, d_k, block_v), lambda i, j, c: (i, j, 0, c))
    out, u = pallas_call(
        functools.partial(_solve_kernel, blocks=blocks, precision=precision, barrier=not interpret),
        [q, k, v, beta, state.astype(jnp.float32), prefix, a, p, x], grid=(b, h_v, d_v // block_v),
        in_specs=[key_head, key_head, columns, head, state_columns,
                  head, square, square, pl.BlockSpec((None, None, w, BLOCK), lambda i, j, c: (i, j, 0, 0))],
        out_specs=[columns, columns], out_shape=[f32(w, d_v), f32(w, d_v)],
        name="tree_gdn_solve", num_warps=4 if w <= 128 else 8, num_stages=1, interpret=interpret, poison=poison)
    return jnp.moveaxis(out[:, :, :t], 1, 2), u[:, :, :t], prefix[:, :, :t]
