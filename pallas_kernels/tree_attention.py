"""Tree attention for verification: N tree nodes attend to the committed prefix `[0, len)` and to
the tree's own K/V (slots `[len, len + N)`) under the ancestor mask, with grouped query heads.

Two Pallas Triton kernels, flash-decoding style:
  1. partials, over a grid of (batch, K/V head, query-row block, split). The rows of a block are
     (node, head) pairs of one K/V head, so each K/V load serves all G query heads of the group.
     Splits `0 .. J-1` take equal shares of that sequence's own prefix (the share follows `len` at
     run time, so a cache much longer than the prefix costs nothing); split J takes the tree's
     slots under the ancestor mask, read per row from the `[N, N]` table (int8, not repeated per
     head: a long prefill's mask stays N x N bytes). Each writes an unnormalised partial (o, m, l).
  2. merge: the J + 1 partials of each row by log-sum-exp, normalised.
J is chosen so that the first kernel has about `PROGRAMS` programs (a couple per multiprocessor of
an H100 / H200). `tree_attention_reference` is the plain masked softmax both must equal.

Shapes: q `[B, N, H, D]`, k_cache / v_cache `[B, S, H_kv, D]` (the tree's K/V already written at
`[len, len + N)`, len + N <= S), lengths `[B]`, ancestors `[B, N, N]` (`Tree.ancestors()`).
Output `[B, N, H, D]` float32. D a power of two >= 16; any S.
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
from weaver_jax.pallas_kernels._call import pallas_call, pow2_at_least

PROGRAMS = 264  # partial-kernel programs to aim for: two per multiprocessor of an H100 / H200 (132)
MERGE_ROWS = 16  # rows per merge program


def tree_attention_reference(q, k_cache, v_cache, lengths, ancestors):
    """The same attention as one masked softmax over all S slots (what the target does in XLA)."""
    b, n, h, d = q.shape
    kv = k_cache.shape[2]
    mask = visibility_mask(lengths, ancestors, k_cache.shape[1])
    return gqa_attention(q.reshape(b, n, kv, h // kv, d), k_cache, v_cache, mask).reshape(b, n, h, d)


def _empty_softmax(rows: int, d: int):
    """An online softmax over no keys yet: o `[rows, d]` = 0, running max m = MASKED_SCORE, total l = 0."""
    return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASKED_SCORE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def _partials_kernel(len_ref, q_ref, k_ref, v_ref, ancestors_ref, o_ref, m_ref, l_ref, *, splits: int, block_k: int,
                     block_t: int, group: int, scale: float):
    """One (batch, K/V head, row block, split): rows `q_ref [R_blk, D]` against the sequence's keys
    `k_ref [S, D]`; `ancestors_ref [N, N_pad]` int8 is the tree's visibility, row r of the block
    being node (block start + r) // group."""
    length, split = len_ref[...], pl.program_id(3)
    q = q_ref[...]
    rows, d = q.shape

    def attend(carry, start, width, limit, visible):
        """Online softmax over keys `[start, start + width)`; keys at or past `limit` are not read."""
        o, m, total = carry
        inside = start + jnp.arange(width) < limit
        keys = plgpu.load(k_ref.at[pl.ds(start, width)], mask=inside[:, None], other=0)
        values = plgpu.load(v_ref.at[pl.ds(start, width)], mask=inside[:, None], other=0)
        s = plgpu.dot(q, keys, trans_b=True) * scale  # [R_blk, width] float32
        s = jnp.where(inside[None, :] if visible is None else visible & inside[None, :], s, MASKED_SCORE)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        correction = jnp.exp(m - m_new)
        o = o * correction[:, None] + plgpu.dot(p.astype(values.dtype), values)
        return o, m_new, total * correction + p.sum(axis=1)

    carry = _empty_softmax(rows, d)
    share = block_k * pl.cdiv(pl.cdiv(length, block_k), splits)  # prefix keys per split
    start = split * share
    # Trip counts as int32 products: a `where` of two constants can lower to i1, which scf.for rejects
    blocks = (split < splits).astype(jnp.int32) * jnp.clip(pl.cdiv(length - start, block_k), 0, share // block_k)
    carry = jax.lax.fori_loop(0, blocks, lambda i, c: attend(c, start + i * block_k, block_k, length, None), carry)
    n, n_pad = ancestors_ref.shape
    nodes = jnp.minimum((pl.program_id(2) * rows + jnp.arange(rows)) // group, n - 1)  # padding rows: any node

    def visible(i):  # [R_blk, block_t]: the rows' ancestor flags for tree keys [i * block_t, (i + 1) * block_t)
        return plgpu.load(ancestors_ref.at[nodes[:, None], (i * block_t + jnp.arange(block_t))[None, :]]) != 0

    tree_blocks = (split == splits).astype(jnp.int32) * (n_pad // block_t)
    carry = jax.lax.fori_loop(0, tree_blocks, lambda i, c: attend(
        c, length + i * block_t, block_t, k_ref.shape[0], visible(i)), carry)
    o_ref[...], m_ref[...], l_ref[...] = carry


def _merge_kernel(o_ref, m_ref, l_ref, out_ref):
    """One (batch, K/V head, row block): partials `o_ref [J + 1, R_blk, D]`, `m_ref`, `l_ref
    [J + 1, R_blk]` -> `out_ref [R_blk, D]`."""
    def merge(j, carry):
        acc, m, total = carry
        m_j = m_ref[j, :]
        m_new = jnp.maximum(m, m_j)
        old, new = jnp.exp(m - m_new), jnp.exp(m_j - m_new)
        return acc * old[:, None] + o_ref[j, :, :] * new[:, None], m_new, total * old + l_ref[j, :] * new

    acc, _, total = jax.lax.fori_loop(0, m_ref.shape[0], merge, _empty_softmax(*out_ref.shape))
    out_ref[...] = acc / total[:, None]


@functools.partial(jax.jit, static_argnames=("block_r", "block_k", "splits", "programs", "num_warps", "num_stages",
                                             "interpret", "poison"))
def tree_attention(q, k_cache, v_cache, lengths, ancestors, *, block_r: int = 64, block_k: int = 64,
                   splits: int | None = None, programs: int = PROGRAMS, num_warps: int = 4, num_stages: int = 3,
                   interpret: bool = False, poison: bool = False):
    """Tree attention in two Pallas kernels (see the module docstring).
    block_r: (node, head) rows per program (at most); block_k: prefix keys per inner step (the tree's
    keys go in steps of min(block_k, N)); splits: prefix splits J (default: enough for about
    `programs` programs in the first kernel); num_warps, num_stages: Triton's launch parameters of the partials kernel.
    poison (tests): outputs start as NaN, so an element no program writes cannot pass."""
    b, n, h, d = q.shape
    s_len, kv = k_cache.shape[1], k_cache.shape[2]
    g = h // kv
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    rows = n * g  # node-major (node, head) pairs of one K/V head, padded to the row block
    block_r = min(pow2_at_least(block_r, 16), pow2_at_least(rows, 16))
    row_blocks = -(-rows // block_r)
    rows_padded = row_blocks * block_r
    block_k = pow2_at_least(block_k, 16)
    block_t = min(block_k, pow2_at_least(n, 16))
    n_pad = -(-n // block_t) * block_t
    if splits is None:
        splits = -(-programs // (b * kv * row_blocks))
    splits = max(1, min(splits, -(-s_len // block_k)))

    qg = q.reshape(b, n, kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, rows, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
    tree_mask = jnp.pad(ancestors.astype(jnp.int8), ((0, 0), (0, 0), (0, n_pad - n)))  # [B, N, N_pad]
    cache_spec = pl.BlockSpec((None, s_len, None, d), lambda i, k, j, c: (i, 0, k, 0))
    partial_specs = [pl.BlockSpec((None, None, None, block_r, d), lambda i, k, j, c: (i, k, c, j, 0)),
                     pl.BlockSpec((None, None, None, block_r), lambda i, k, j, c: (i, k, c, j)),
                     pl.BlockSpec((None, None, None, block_r), lambda i, k, j, c: (i, k, c, j))]
    columns = splits + 1
    partials = pallas_call(
        functools.partial(_partials_kernel, splits=splits, block_k=block_k, block_t=block_t, group=g,
                          scale=1 / math.sqrt(d)),
        [lengths.astype(jnp.int32), qg, k_cache, v_cache, tree_mask], grid=(b, kv, row_blocks, columns),
        in_specs=[pl.BlockSpec((None,), lambda i, k, j, c: (i,)),
                  pl.BlockSpec((None, None, block_r, d), lambda i, k, j, c: (i, k, j, 0)), cache_spec, cache_spec,
                  pl.BlockSpec((None, n, n_pad), lambda i, k, j, c: (i, 0, 0))],
        out_specs=partial_specs,
        out_shape=[jax.ShapeDtypeStruct((b, kv, columns, rows_padded, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, columns, rows_padded), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, columns, rows_padded), jnp.float32)],
        name="tree_attention_partials", num_warps=num_warps, num_stages=num_stages, interpret=interpret, poison=poison)
    # The merge reads J + 1 partials per row: many small programs, loads pipelined over J
    merge_rows = min(MERGE_ROWS, block_r)
    merge_spec = lambda *tail: pl.BlockSpec((None, None, columns, merge_rows, *tail),  # noqa: E731
                                            lambda i, k, j: (i, k, 0, j, *(0 for _ in tail)))
    out = pallas_call(
        _merge_kernel, partials, grid=(b, kv, rows_padded // merge_rows),
        in_specs=[merge_spec(d), merge_spec(), merge_spec()],
        out_specs=pl.BlockSpec((None, None, merge_rows, d), lambda i, k, j: (i, k, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kv, rows_padded, d), jnp.float32),
        name="tree_attention_merge", num_warps=4, num_stages=3, interpret=interpret, poison=poison)
    return out[:, :, :rows].reshape(b, kv, n, g, d).transpose(0, 2, 1, 3, 4).reshape(b, n, h, d)
