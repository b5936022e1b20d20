"""Tree attention for verification: N tree nodes attend to the committed prefix `[0, len)` and to
the tree's own K/V (slots `[len, len + N)`) under the ancestor mask, with grouped query heads.

The prefix is long and the tree small, so they are split: a Pallas Triton kernel covers the
prefix flash-decoding style, over a grid of (batch, K/V head, query-row block, prefix chunk).
Each program reads its chunk of K/V once for all G query heads of the group (the rows of a block
are node x head pairs of one K/V head) and writes an unnormalised partial (o, m, l); chunks past
`len` exit at once. The tree part (N <= a few hundred keys) is a small XLA attention. The partials
merge by log-sum-exp. `tree_attention_reference` is the plain masked softmax it must equal.

Shapes: q `[B, N, H, D]`, k_cache / v_cache `[B, S, H_kv, D]` (the tree's K/V already written at
`[len, len + N)`), lengths `[B]`, ancestors `[B, N, N]` (`Tree.ancestors()`). Output `[B, N, H, D]`
float32. D a power of two >= 16; S a multiple of 16 (the wrapper pads the cache otherwise).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from weaver_jax._model import gqa_attention, visibility_mask
from weaver_jax.pallas_kernels import MASKED_SCORE


def tree_attention_reference(q, k_cache, v_cache, lengths, ancestors):
    """The same attention as one masked softmax over all S slots (what the target does in XLA)."""
    b, n, h, d = q.shape
    kv = k_cache.shape[2]
    mask = visibility_mask(lengths, ancestors, k_cache.shape[1])
    return gqa_attention(q.reshape(b, n, kv, h // kv, d), k_cache, v_cache, mask).reshape(b, n, h, d)


def _prefix_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_k: int, chunk: int, scale: float):
    """One (batch, K/V head, row block, chunk): rows `q_ref [R_blk, D]` over keys `k_ref [chunk, D]`."""
    start = pl.program_id(3) * chunk
    length = len_ref[...]
    q = q_ref[...]
    rows, d = q.shape

    def body(i, carry):
        o, m, total = carry
        keys = k_ref[pl.ds(i * block_k, block_k), :]
        values = v_ref[pl.ds(i * block_k, block_k), :]
        s = plgpu.dot(q, keys, trans_b=True) * scale  # [R_blk, block_k] float32
        position = start + i * block_k + jnp.arange(block_k)
        s = jnp.where((position < length)[None, :], s, MASKED_SCORE)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        correction = jnp.exp(m - m_new)
        o = o * correction[:, None] + plgpu.dot(p.astype(values.dtype), values)
        return o, m_new, total * correction + p.sum(axis=1)

    blocks = jnp.clip(pl.cdiv(length - start, block_k), 0, chunk // block_k)
    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASKED_SCORE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, total = jax.lax.fori_loop(0, blocks, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = total


def _pow2_at_least(n: int, low: int) -> int:
    return max(low, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _prefix_partials(qg, k_cache, v_cache, lengths, *, block_r, block_k, chunk, num_warps, num_stages, interpret,
                     poison):
    """qg `[B, H_kv, R, D]` -> o `[B, H_kv, J, R, D]`, m, l `[B, H_kv, J, R]` (J = S / chunk)."""
    b, kv, r, d = qg.shape
    splits = k_cache.shape[1] // chunk
    grid = (b, kv, r // block_r, splits)
    shapes = [jax.ShapeDtypeStruct((b, kv, splits, r, d), jnp.float32),
              jax.ShapeDtypeStruct((b, kv, splits, r), jnp.float32),
              jax.ShapeDtypeStruct((b, kv, splits, r), jnp.float32)]
    kernel = functools.partial(_prefix_kernel, block_k=block_k, chunk=chunk, scale=1 / math.sqrt(d))
    in_specs = [pl.BlockSpec((None,), lambda i, h, j, c: (i,)),
                pl.BlockSpec((None, None, block_r, d), lambda i, h, j, c: (i, h, j, 0)),
                pl.BlockSpec((None, chunk, None, d), lambda i, h, j, c: (i, c, h, 0)),
                pl.BlockSpec((None, chunk, None, d), lambda i, h, j, c: (i, c, h, 0))]
    out_specs = [pl.BlockSpec((None, None, None, block_r, d), lambda i, h, j, c: (i, h, c, j, 0)),
                 pl.BlockSpec((None, None, None, block_r), lambda i, h, j, c: (i, h, c, j)),
                 pl.BlockSpec((None, None, None, block_r), lambda i, h, j, c: (i, h, c, j))]
    args = [lengths.astype(jnp.int32), qg, k_cache, v_cache]
    aliases = {}
    if poison:  # tests: outputs start as NaN, so an element no program writes cannot pass
        in_specs += out_specs
        args += [jnp.full(s.shape, jnp.nan, s.dtype) for s in shapes]
        aliases = {4 + i: i for i in range(3)}

        def kernel(len_ref, q_ref, k_ref, v_ref, _o, _m, _l, o_ref, m_ref, l_ref, inner=kernel):
            inner(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref)

    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=shapes,
                          input_output_aliases=aliases, interpret=interpret, name="tree_attention_prefix",
                          compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))(*args)


@functools.partial(jax.jit, static_argnames=("block_r", "block_k", "chunk", "num_warps", "num_stages", "interpret",
                                             "poison"))
def tree_attention(q, k_cache, v_cache, lengths, ancestors, *, block_r: int = 64, block_k: int = 64, chunk: int = 512,
                   num_warps: int = 4, num_stages: int = 2, interpret: bool = False, poison: bool = False):
    """Tree attention with the prefix in the Pallas kernel (see the module docstring).
    block_r: (node, head) rows per program (at most); block_k: keys per inner step; chunk: prefix
    slots per program (both rounded to fit S); num_warps, num_stages: Triton's launch parameters."""
    b, n, h, d = q.shape
    s_len, kv = k_cache.shape[1], k_cache.shape[2]
    g = h // kv
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    if s_len % 16:  # the kernel's blocks tile S; a padded copy keeps it correct for odd sizes
        pad = ((0, 0), (0, 16 - s_len % 16), (0, 0), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
        s_len = k_cache.shape[1]
    block_k = math.gcd(s_len, _pow2_at_least(block_k, 16))
    chunk = max(block_k, math.gcd(s_len, _pow2_at_least(chunk, block_k)))
    # Rows: node-major (node, head) pairs of one K/V head, padded to the row block.
    rows = n * g
    block_r = min(_pow2_at_least(block_r, 16), _pow2_at_least(rows, 16))
    rows_padded = -(-rows // block_r) * block_r
    qg = q.reshape(b, n, kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, rows, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
    o_p, m_p, l_p = _prefix_partials(qg, k_cache, v_cache, lengths, block_r=block_r, block_k=block_k, chunk=chunk,
                                     num_warps=num_warps, num_stages=num_stages, interpret=interpret, poison=poison)
    def unrow(x):  # [B, H_kv, J, R_padded, (D)] -> [B, H_kv, J, N, G, (D)]
        return x[:, :, :, :rows].reshape(*x.shape[:3], n, g, *x.shape[4:])

    o_p, m_p, l_p = unrow(o_p), unrow(m_p), unrow(l_p)

    # The tree's own keys: slots len + t, visible as the ancestor mask says.
    slots = jnp.minimum(lengths[:, None] + jnp.arange(n)[None, :], s_len - 1)
    k_tree = jnp.take_along_axis(k_cache, slots[:, :, None, None], axis=1)  # [B, N, H_kv, D]
    v_tree = jnp.take_along_axis(v_cache, slots[:, :, None, None], axis=1)
    qn = q.reshape(b, n, kv, g, d)
    s_t = jnp.einsum("bnkgd,btkd->bkngt", qn, k_tree, preferred_element_type=jnp.float32) / math.sqrt(d)
    s_t = jnp.where(ancestors[:, None, :, None, :], s_t, MASKED_SCORE)
    m_t = s_t.max(-1)  # [B, H_kv, N, G]
    p_t = jnp.exp(s_t - m_t[..., None])
    l_t = p_t.sum(-1)
    o_t = jnp.einsum("bkngt,btkd->bkngd", p_t.astype(v_tree.dtype), v_tree, preferred_element_type=jnp.float32)

    m = jnp.maximum(m_t, m_p.max(axis=2))
    w_p, w_t = jnp.exp(m_p - m[:, :, None]), jnp.exp(m_t - m)
    o = o_t * w_t[..., None] + (o_p * w_p[..., None]).sum(axis=2)
    total = l_t * w_t + (l_p * w_p).sum(axis=2)
    out = o / total[..., None]  # [B, H_kv, N, G, D]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, n, h, d)
