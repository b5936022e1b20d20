"""Tree attention for verification: N tree nodes attend to the committed prefix `[0, len)` and to
the tree's own K/V (slots `[len, len + N)`) under the ancestor mask, with grouped query heads.

Two Pallas Triton kernels, flash-decoding style:
  1. partials, over a grid of (batch, K/V head, query-row block, split). The rows of a block are
     (node, head) pairs of one K/V head, so each K/V load serves all G query heads of the group.
     Splits `0 .. J-1` take equal shares of that sequence's own prefix: the split count and the
     share follow `len` at run time (`_busy_splits`), so no key past the prefix is read and a short
     prefix is not cut into splits shorter than their partials are worth; split J takes the tree's
     slots under the ancestor mask, read per row from the `[N, N]` table (int8, not repeated per
     head: a long prefill's mask stays N x N bytes). Each writes an unnormalised partial (o, m, l).
  2. merge: the partials of each row by log-sum-exp, normalised, several partials per load.
The row block and J are chosen from the grid and the cache size (measured on an H200, BENCHMARKS.md).
`tree_attention_reference` is the plain masked softmax both must equal.

Shapes: q `[B, N, H, D]`, k_cache / v_cache `[B, S, H_kv, D]` (the tree's K/V already written at
`[len, len + N)`, len + N <= S), lengths `[B]`, ancestors `[B, N, N]` (`Tree.ancestors()`).
Output `[B, N, H, D]` in q's dtype (accumulated in float32). D a power of two >= 16; any S.
The kernels read q's and write the output's (node, head) rows in place: no transposed copies.
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

PROGRAMS = 264  # prefix programs to aim for: two per multiprocessor of an H100 / H200 (132), what fits with
# 2 pipeline stages (3 stages' K/V buffers leave room for one: measured 25-40% slower)
MERGE_ROWS = 16  # rows per merge program (at most)
MERGE_COLUMNS = 16  # partials per row the merge reads at once (at most)
MERGE_TILE = 8192  # float32 elements of the merge's [columns, rows, D] tile: 64 registers a thread


def tree_attention_reference(q, k_cache, v_cache, lengths, ancestors):
    """The same attention as one masked softmax over all S slots (what the target does in XLA)."""
    b, n, h, d = q.shape
    kv = k_cache.shape[2]
    mask = visibility_mask(lengths, ancestors, k_cache.shape[1])
    return gqa_attention(q.reshape(b, n, kv, h // kv, d), k_cache, v_cache, mask).reshape(b, n, h, d)


def default_block_r(batch: int, kv_heads: int, rows: int, cache_size: int, programs: int = PROGRAMS) -> int:
    """Row block for `rows` (node, head) rows per K/V head. Blocks of 128 halve the K/V loads per
    row and pay where rows are many (>= 512), or where the grid keeps prefix splits to give (blocks
    of 64 would leave at least 4 programs per (K/V head, row block) pair) over a long cache (16K:
    15% faster at B = 1, N = 64; 4K: even; 1K: 64 faster); where pairs are already many (B = 8,
    N = 64) 64 measured faster (BENCHMARKS.md)."""
    few_pairs = batch * kv_heads * -(-rows // 64) <= programs // 4
    return 128 if rows >= 512 or (few_pairs and cache_size >= 8192) else 64


def _busy_splits(length, splits: int, least: int, min_keys: int):
    """Prefix splits a sequence of `length` keys uses, of the J = `splits` launched: one per
    `min_keys` keys (a split also writes and the merge reads its partial of block_r x D:
    shorter splits spend more time on that than on their keys), at least `least` (which fills the
    multiprocessors once). Both kernels compute it from `len` at run time."""
    return jnp.clip(pl.cdiv(length, min_keys), least, splits)


def _empty_softmax(rows: int, d: int):
    """An online softmax over no keys yet: o `[rows, d]` = 0, running max m = MASKED_SCORE, total l = 0."""
    return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASKED_SCORE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def _query_rows(block: int, rows: int, group: int, heads: int, nodes: int):
    """The rows `[rows]` of q / out `[N * H, D]` that row block `block` of K/V head `program_id(1)`
    holds: its rows are (node, head) pairs, node-major, so each K/V load serves the group's G query
    heads. Returns each row's node and index. Padding rows past N * G repeat the last node's rows:
    they compute the same values, so writing them back is harmless (a masked store would not be
    in interpret mode, whose scatter lets a skipped duplicate put back the old value)."""
    r = block * rows + jnp.arange(rows)
    node = jnp.minimum(r // group, nodes - 1)
    return node, node * heads + pl.program_id(1) * group + r % group


def _partials_kernel(len_ref, q_ref, k_ref, v_ref, ancestors_ref, o_ref, m_ref, l_ref, *, splits: int, least: int,
                     min_keys: int, block_k: int, block_t: int, group: int, scale: float):
    """One (batch, K/V head, row block, split): rows of `q_ref [N * H, D]` against the sequence's
    keys `k_ref [S, D]`; `ancestors_ref [N, N]` int8 is the tree's visibility. Scores are kept in
    base-2 units (`scale` includes log2(e)), so the softmax takes exp2. A prefix split past the
    sequence's busy ones writes nothing (the merge skips it)."""
    length, split = len_ref[...], pl.program_id(3)
    busy = _busy_splits(length, splits, least, min_keys)
    n, d = ancestors_ref.shape[0], q_ref.shape[1]
    rows = m_ref.shape[0]
    nodes, q_rows = _query_rows(pl.program_id(2), rows, group, q_ref.shape[0] // n, n)
    q = plgpu.load(q_ref.at[q_rows[:, None], jnp.arange(d)[None, :]])

    def attend(carry, start, width, limit=None, visible=None):
        """Online softmax over keys `[start, start + width)`. limit None: all of them are read and
        seen (no masking work); else keys at or past `limit` are not read, and `visible [R_blk,
        width]` (None: all) says which rows see which key."""
        o, m, total = carry
        if limit is None:
            keys, values = k_ref[pl.ds(start, width), :], v_ref[pl.ds(start, width), :]
        else:
            inside = start + jnp.arange(width) < limit
            keys = plgpu.load(k_ref.at[pl.ds(start, width)], mask=inside[:, None], other=0)
            values = plgpu.load(v_ref.at[pl.ds(start, width)], mask=inside[:, None], other=0)
        s = plgpu.dot(q, keys, trans_b=True) * scale  # [R_blk, width] float32
        if limit is not None:
            s = jnp.where(inside[None, :] if visible is None else visible & inside[None, :], s, MASKED_SCORE)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2(s - m_new[:, None])
        correction = jnp.exp2(m - m_new)
        o = o * correction[:, None] + plgpu.dot(p.astype(values.dtype), values)
        return o, m_new, total * correction + p.sum(axis=1)

    carry = _empty_softmax(rows, d)
    # This split's prefix keys [start, start + count): whole blocks unmasked, then one masked tail.
    # Trip counts as int32 products: a `where` of two constants can lower to i1, which scf.for rejects
    share = block_k * pl.cdiv(pl.cdiv(length, block_k), busy)
    start = split * share
    count = (split < busy).astype(jnp.int32) * jnp.clip(length - start, 0, share)
    carry = jax.lax.fori_loop(0, count // block_k, lambda i, c: attend(c, start + i * block_k, block_k), carry)
    carry = jax.lax.fori_loop(0, (count % block_k > 0).astype(jnp.int32), lambda i, c: attend(
        c, start + count // block_k * block_k, block_k, length), carry)

    def visible(i):  # [R_blk, block_t]: the rows' ancestor flags for tree keys [i * block_t, (i + 1) * block_t)
        columns = i * block_t + jnp.arange(block_t)
        return plgpu.load(ancestors_ref.at[nodes[:, None], columns[None, :]], mask=columns[None, :] < n, other=0) != 0

    tree_blocks = (split == splits).astype(jnp.int32) * pl.cdiv(n, block_t)
    carry = jax.lax.fori_loop(0, tree_blocks, lambda i, c: attend(
        c, length + i * block_t, block_t, k_ref.shape[0], visible(i)), carry)

    @pl.when((split < busy) | (split == splits))
    def _store():
        o_ref[...], m_ref[...], l_ref[...] = carry[0].astype(o_ref.dtype), carry[1], carry[2]


def _merge_kernel(len_ref, o_ref, m_ref, l_ref, out_ref, *, group: int, nodes: int, width: int, splits: int,
                  least: int, min_keys: int):
    """One (batch, K/V head, row block): partials `o_ref [C, R_blk, D]`, `m_ref`, `l_ref [C, R_blk]`
    -> the block's rows of `out_ref [N * H, D]`. The columns are loaded `width` at a time as one
    tile, so their loads are in flight together (a loop of one column per step waits for each in
    turn: 18 us at 4K, N = 64, of a 57 us call); only the busy prefix splits' columns and the tree's
    (J) were written (C rounds J + 1 up to `width`): the rest are masked, and not read."""
    columns, rows, d = o_ref.shape
    busy = _busy_splits(len_ref[...], splits, least, min_keys)

    def merge(c, carry):
        acc, m, total = carry
        chunk = pl.ds(c * width, width)
        column = c * width + jnp.arange(width)
        inside = (column < busy) | (column == splits)
        m_c = plgpu.load(m_ref.at[chunk], mask=inside[:, None], other=MASKED_SCORE)  # [W, R_blk]
        l_c = plgpu.load(l_ref.at[chunk], mask=inside[:, None], other=0)
        o_c = plgpu.load(o_ref.at[chunk], mask=inside[:, None, None], other=0).astype(jnp.float32)  # [W, R_blk, D]
        m_new = jnp.maximum(m, m_c.max(axis=0))
        old, new = jnp.exp2(m - m_new), jnp.exp2(m_c - m_new[None, :])
        return acc * old[:, None] + (o_c * new[:, :, None]).sum(axis=0), m_new, total * old + (l_c * new).sum(axis=0)

    acc, _, total = jax.lax.fori_loop(0, columns // width, merge, _empty_softmax(rows, d))
    _, out_rows = _query_rows(pl.program_id(2), rows, group, out_ref.shape[0] // nodes, nodes)
    plgpu.store(out_ref.at[out_rows[:, None], jnp.arange(d)[None, :]], (acc / total[:, None]).astype(out_ref.dtype))


@functools.partial(jax.jit, static_argnames=("block_r", "block_k", "splits", "programs", "num_warps", "num_stages",
                                             "partials_dtype", "interpret", "poison"))
def tree_attention(q, k_cache, v_cache, lengths, ancestors, *, block_r: int | None = None, block_k: int = 64,
                   splits: int | None = None, programs: int = PROGRAMS, num_warps: int = 4, num_stages: int = 2,
                   partials_dtype: str | None = None, interpret: bool = False, poison: bool = False):
    """Tree attention in two Pallas kernels (see the module docstring).
    block_r: (node, head) rows per program (at most); block_k: prefix keys per inner step (the tree's
    keys go in steps of min(block_k, N)); splits: prefix splits J, all used (default: see below and
    `_busy_splits`); num_warps, num_stages: Triton's launch parameters of the partials kernel;
    partials_dtype: of the unnormalised partial outputs (default: bfloat16 for bfloat16 q, which
    halves what the merge reads: 2-11% faster per call on an H200; else float32, since a float16
    sum over a long split can overflow).
    poison (tests): outputs start as NaN, so an element no program writes cannot pass."""
    b, n, h, d = q.shape
    s_len, kv = k_cache.shape[1], k_cache.shape[2]
    g = h // kv
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    rows = n * g  # node-major (node, head) pairs of one K/V head, padded to the row block
    block_r = block_r or default_block_r(b, kv, rows, s_len, programs)
    block_r = min(pow2_at_least(block_r, 16), pow2_at_least(rows, 16))
    row_blocks = -(-rows // block_r)
    rows_padded = row_blocks * block_r
    block_k = pow2_at_least(block_k, 16)
    block_t = min(block_k, pow2_at_least(n, 16))
    pairs = b * kv * row_blocks
    # J: at most one wave of prefix programs (a second wave of shorter splits measured slower; the tree's
    # column beside them is short), and no more than the cache can keep busy; at run time each sequence
    # uses one per 4 x block_r keys of its length, at least one program per multiprocessor
    min_keys = 4 * block_r
    if splits is None:
        least = max(1, programs // 2 // pairs)
        splits = min(programs // pairs, max(least, s_len // min_keys))
    else:
        least = splits  # an explicit J is used whole
    splits = max(1, min(splits, -(-s_len // block_k)))
    least = min(least, splits)
    width = min(MERGE_COLUMNS, pow2_at_least(splits + 1))  # columns the merge reads per step
    columns = -(-(splits + 1) // width) * width  # allocated; the merge reads the written ones
    merge_rows = max(2, min(MERGE_ROWS, MERGE_TILE // (width * d), block_r))

    q_rows = q.reshape(b, n * h, d)  # the kernels gather their (node, head) rows: no transposed copy of q
    tree_mask = ancestors.astype(jnp.int8)  # a no-op for the model, which passes its int8 table
    cache_spec = pl.BlockSpec((None, s_len, None, d), lambda i, k, j, c: (i, 0, k, 0))
    partial_specs = [pl.BlockSpec((None, None, None, block_r, d), lambda i, k, j, c: (i, k, c, j, 0)),
                     pl.BlockSpec((None, None, None, block_r), lambda i, k, j, c: (i, k, c, j)),
                     pl.BlockSpec((None, None, None, block_r), lambda i, k, j, c: (i, k, c, j))]
    lengths = lengths.astype(jnp.int32)
    partials_dtype = partials_dtype or (jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32)
    partials = pallas_call(
        functools.partial(_partials_kernel, splits=splits, least=least, min_keys=min_keys, block_k=block_k,
                          block_t=block_t, group=g, scale=math.log2(math.e) / math.sqrt(d)),
        [lengths, q_rows, k_cache, v_cache, tree_mask], grid=(b, kv, row_blocks, splits + 1),
        in_specs=[pl.BlockSpec((None,), lambda i, k, j, c: (i,)),
                  pl.BlockSpec((None, n * h, d), lambda i, k, j, c: (i, 0, 0)), cache_spec, cache_spec,
                  pl.BlockSpec((None, n, n), lambda i, k, j, c: (i, 0, 0))],
        out_specs=partial_specs,
        out_shape=[jax.ShapeDtypeStruct((b, kv, columns, rows_padded, d), partials_dtype),
                   jax.ShapeDtypeStruct((b, kv, columns, rows_padded), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, columns, rows_padded), jnp.float32)],
        name="tree_attention_partials", num_warps=num_warps, num_stages=num_stages, interpret=interpret, poison=poison)
    # The merge: many small programs, each writing its rows straight into the [B, N, H, D] output
    merge_spec = lambda *tail: pl.BlockSpec((None, None, columns, merge_rows, *tail),  # noqa: E731
                                            lambda i, k, j: (i, k, 0, j, *(0 for _ in tail)))
    out = pallas_call(
        functools.partial(_merge_kernel, group=g, nodes=n, width=width, splits=splits, least=least,
                          min_keys=min_keys), [lengths, *partials],
        grid=(b, kv, rows_padded // merge_rows),
        in_specs=[pl.BlockSpec((None,), lambda i, k, j: (i,)), merge_spec(d), merge_spec(), merge_spec()],
        out_specs=pl.BlockSpec((None, n * h, d), lambda i, k, j: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, n * h, d), q.dtype),
        name="tree_attention_merge", num_warps=4, num_stages=3, interpret=interpret, poison=poison)
    return out.reshape(b, n, h, d)
