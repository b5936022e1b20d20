"""Tree verification of a Gated DeltaNet layer in one Pallas (Triton) program per (sequence, value
head): every node's output along its own root-to-node path from the committed state, with no
per-node state written (`weaver_jax._gdn` has the algebra; `gated_delta_tree` is the reference).

Inside a program, for the tree's T nodes (padded to a power of two >= 16):
  prefix = ancestors-or-self @ g; ratio_ij = exp(prefix_i - prefix_j) on i's path, else 0;
  A = beta_i ratio_ij (k_i . k_j) over strict ancestors; rhs = beta (v - exp(prefix) k S0);
  u = rhs - A u, iterated `levels` times from u = rhs: A only carries a node's value to its
  descendants, so after d iterations every node of depth <= d holds its exact solution (forward
  substitution by level, as stable as the sequential one, a T x T product per level instead of a row
  at a time);
  out = exp(prefix) q S0 + (ratio * q k^T) u.
Outputs: out `[B, T, H_v, d_v]` float32, and u `[B, H_v, T, d_v]`, prefix `[B, H_v, T]` for `fold`.

Shapes: q, k `[B, T, H_k, d_k]` (L2-normalised, q scaled), v `[B, T, H_v, d_v]`, g, beta `[B, T, H_v]`,
state `[B, H_v, d_k, d_v]` float32, ancestors `[B, T, T]` bool; d_k, d_v powers of two >= 16; value
head h reads key head h // (H_v / H_k).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from weaver_jax._gdn import gated_delta_tree
from weaver_jax.pallas_kernels._call import pallas_call, pow2_at_least

_IEEE = jax.lax.Precision.HIGHEST  # float32 products at full precision (not TF32)


def tree_gdn_reference(q, k, v, g, beta, state, ancestors):
    """-> (out, u, prefix) as the kernel returns them, from `weaver_jax._gdn.gated_delta_tree`."""
    out, terms = gated_delta_tree(q, k, v, g, beta, state, ancestors)
    return out, terms.u, terms.prefix


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, own_ref, out_ref, u_ref, prefix_ref, *, levels: int):
    """One (sequence, value head): q_ref, k_ref `[T, d_k]`, v_ref `[T, d_v]`, g_ref, beta_ref `[T]`,
    s_ref `[d_k, d_v]`, own_ref `[T, T]` int8 (ancestors-or-self)."""
    t = own_ref.shape[0]
    own = own_ref[...] != 0
    q, k, v = q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32)
    g, beta, s = g_ref[...], beta_ref[...], s_ref[...]
    prefix = jnp.sum(jnp.where(own, g[None, :], 0.0), axis=1)  # [T]
    ratio = jnp.where(own, jnp.exp(jnp.minimum(prefix[:, None] - prefix[None, :], 0.0)), 0.0)
    strict = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (t, t), 0) == jax.lax.broadcasted_iota(
        jnp.int32, (t, t), 1), 0.0, ratio)
    system = beta[:, None] * strict * plgpu.dot(k, k, trans_b=True, precision=_IEEE)  # [T, T]
    decay = jnp.exp(prefix)[:, None]
    rhs = beta[:, None] * (v - decay * plgpu.dot(k, s, precision=_IEEE))  # [T, d_v]
    u = jax.lax.fori_loop(0, levels, lambda _, u: rhs - plgpu.dot(system, u, precision=_IEEE), rhs)
    scores = ratio * plgpu.dot(q, k, trans_b=True, precision=_IEEE)
    out_ref[...] = decay * plgpu.dot(q, s, precision=_IEEE) + plgpu.dot(scores, u, precision=_IEEE)
    u_ref[...] = u
    prefix_ref[...] = prefix


@functools.partial(jax.jit, static_argnames=("levels", "interpret", "poison"))
def tree_gdn(q, k, v, g, beta, state, ancestors, *, levels: int | None = None, interpret: bool = False,
             poison: bool = False):
    """The tree's GDN outputs and fold terms (module docstring). levels: at least the tree's deepest
    depth (default: T - 1, always enough). poison (tests): outputs start as NaN."""
    b, t, h_k, d_k = q.shape
    h_v, d_v = v.shape[2], v.shape[3]
    if h_v % h_k:
        raise ValueError(f"{h_v} value heads do not share {h_k} key heads evenly")
    for name, d in (("d_k", d_k), ("d_v", d_v)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{name} = {d} must be a power of two >= 16")
    n = pow2_at_least(t, 16)  # padded nodes: their own rows only, beta 0: they write and read nothing
    pad = n - t

    def nodes(x):  # node axis 1 -> padded, heads first: [B, H, n, ...]
        return jnp.moveaxis(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)), 2, 1)

    own = jnp.pad(ancestors, [(0, 0), (0, pad), (0, pad)]) | (jnp.eye(n, dtype=bool) & (jnp.arange(n) >= t))
    repeat = h_v // h_k
    key_head = lambda i, j: (i, j // repeat, 0, 0)  # noqa: E731
    value_head = lambda i, j: (i, j, 0, 0)  # noqa: E731
    out, u, prefix = pallas_call(
        functools.partial(_kernel, levels=t - 1 if levels is None else levels),
        [nodes(q), nodes(k), nodes(v), nodes(g.astype(jnp.float32)), nodes(beta.astype(jnp.float32)),
         state.astype(jnp.float32), own.astype(jnp.int8)],
        grid=(b, h_v),
        in_specs=[pl.BlockSpec((None, None, n, d_k), key_head), pl.BlockSpec((None, None, n, d_k), key_head),
                  pl.BlockSpec((None, None, n, d_v), value_head),
                  pl.BlockSpec((None, None, n), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((None, None, n), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((None, None, d_k, d_v), value_head), pl.BlockSpec((None, n, n), lambda i, j: (i, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, n, d_v), value_head), pl.BlockSpec((None, None, n, d_v), value_head),
                   pl.BlockSpec((None, None, n), lambda i, j: (i, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, h_v, n, d_v), jnp.float32),
                   jax.ShapeDtypeStruct((b, h_v, n, d_v), jnp.float32),
                   jax.ShapeDtypeStruct((b, h_v, n), jnp.float32)],
        name="tree_gdn", num_warps=8, num_stages=1, interpret=interpret, poison=poison)
    return jnp.moveaxis(out[:, :, :t], 1, 2), u[:, :, :t], prefix[:, :, :t]
