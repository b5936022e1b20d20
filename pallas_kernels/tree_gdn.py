"""Tree verification of a Gated DeltaNet layer in one Pallas (Triton) program per (sequence, value
head, `block_v` value columns): every node's output along its own root-to-node path from the
committed state, with no per-node state written (`weaver_jax._gdn` has the algebra;
`gated_delta_tree` is the reference).

Nodes come in tree order (a node's ancestors before it), so the system below is lower triangular;
the program walks the T nodes in blocks of 16 (static, unrolled), every tile 16 x 16 or 16 x d:
  prefix = ancestors-or-self @ g; ratio_ij = exp(prefix_i - prefix_j) on i's path, else 0;
  A = beta_i ratio_ij (k_i . k_j) over strict ancestors; rhs = beta (v - exp(prefix) k S0);
  (I + A) u = rhs by blocks: u_r = (I + A_rr)^-1 (rhs_r - sum_{c<r} A_rc u_c), the 16 x 16 inverse
  by X <- I - A_rr X 15 times (exact: A_rr is strictly lower; stable as forward substitution is:
  the product (I - N)(I + N^2)(I + N^4)(I + N^8), also exact, lost 3e-4 on deep chains);
  out = exp(prefix) q S0 + (ratio * q k^T) u.
The solve's columns are independent, so value columns split across programs (more programs at
batch 1, a smaller state tile each); the T x T matrices are never held whole (a 129-node tree
padded to 256 did not fit in one program). Outputs: out `[B, T, H_v, d_v]` float32, and u
`[B, H_v, T, d_v]`, prefix `[B, H_v, T]` for `fold`.

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
_IEEE = jax.lax.Precision.HIGHEST  # float32 products at full precision (not TF32)


def tree_gdn_reference(q, k, v, g, beta, state, ancestors):
    """-> (out, u, prefix) as the kernel returns them, from `weaver_jax._gdn.gated_delta_tree`."""
    out, terms = gated_delta_tree(q, k, v, g, beta, state, ancestors)
    return out, terms.u, terms.prefix


def _dot(a, b, trans_b=False):
    return plgpu.dot(a, b, trans_b=trans_b, precision=_IEEE)


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, own_ref, out_ref, u_ref, prefix_ref):
    """One (sequence, value head, column block): q_ref, k_ref `[n, d_k]`, v_ref `[n, block_v]`, g_ref,
    beta_ref `[n]`, s_ref `[d_k, block_v]`, own_ref `[n, n]` int8 (ancestors-or-self); n = 16 x blocks."""
    blocks = own_ref.shape[0] // BLOCK
    rows = [pl.ds(r * BLOCK, BLOCK) for r in range(blocks)]
    s = s_ref[...]
    diagonal = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0) == jax.lax.broadcasted_iota(
        jnp.int32, (BLOCK, BLOCK), 1)
    eye = diagonal.astype(jnp.float32)
    own = {(r, c): own_ref[rows[r], rows[c]] != 0 for r in range(blocks) for c in range(r + 1)}
    g = [g_ref[rows[c]] for c in range(blocks)]
    prefix = [sum(jnp.sum(jnp.where(own[r, c], g[c][None, :], 0.0), axis=1) for c in range(r + 1))
              for r in range(blocks)]
    u = []
    for r in range(blocks):
        q_r, k_r = q_ref[rows[r], :].astype(jnp.float32), k_ref[rows[r], :].astype(jnp.float32)
        beta_r, decay_r = beta_ref[rows[r]][:, None], jnp.exp(prefix[r])[:, None]
        rhs = beta_r * (v_ref[rows[r], :].astype(jnp.float32) - decay_r * _dot(k_r, s))
        out = decay_r * _dot(q_r, s)
        ratios, keys = [], []
        for c in range(r + 1):
            ratio = jnp.where(own[r, c], jnp.exp(jnp.minimum(prefix[r][:, None] - prefix[c][None, :], 0.0)), 0.0)
            k_c = k_r if c == r else k_ref[rows[c], :].astype(jnp.float32)
            ratios.append(ratio)
            keys.append(k_c)
            if c < r:
                rhs -= _dot(beta_r * ratio * _dot(k_r, k_c, trans_b=True), u[c])
        within = jnp.where(diagonal, 0.0, beta_r * ratios[r] * _dot(k_r, k_r, trans_b=True))
        inverse = jax.lax.fori_loop(0, BLOCK - 1, lambda _, x, a=within: eye - _dot(a, x), eye)
        u.append(_dot(inverse, rhs))
        for c in range(r + 1):
            out += _dot(ratios[c] * _dot(q_r, keys[c], trans_b=True), u[c])
        out_ref[rows[r], :] = out
        u_ref[rows[r], :] = u[r]
        prefix_ref[rows[r]] = prefix[r]


@functools.partial(jax.jit, static_argnames=("block_v", "interpret", "poison"))
def tree_gdn(q, k, v, g, beta, state, ancestors, *, block_v: int = 32, interpret: bool = False,
             poison: bool = False):
    """The tree's GDN outputs and fold terms (module docstring). block_v: value columns per program
    (a power of two >= 16; at most d_v). poison (tests): outputs start as NaN."""
    b, t, h_k, d_k = q.shape
    h_v, d_v = v.shape[2], v.shape[3]
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
        _kernel,
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
