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

`tree_attention_from_qkv` is the same attention from the fused projection's output `[B, N, (H + 2 H_kv) D]`:
its partials kernel norms and rotates q and the new keys and writes the new K/V into the cache (aliased), what
the model otherwise does in six small kernels a layer (`tree_attention_from_qkv_reference`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

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


def _softmax_step(carry, q, keys, values, scale: float, visible=None):
    """The online softmax over one block of keys `[W, D]` for rows q `[R_blk, D]`; visible `[R_blk, W]` (None:
    every row sees every key) masks scores. Scores are in base-2 units (`scale` includes log2(e))."""
    o, m, total = carry
    s = plgpu.dot(q, keys, trans_b=True) * scale  # [R_blk, width] float32
    if visible is not None:
        s = jnp.where(visible, s, MASKED_SCORE)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp2(s - m_new[:, None])
    correction = jnp.exp2(m - m_new)
    o = o * correction[:, None] + plgpu.dot(p.astype(values.dtype), values)
    return o, m_new, total * correction + p.sum(axis=1)


def _prefix_share(carry, q, k_ref, v_ref, length, busy, *, block_k: int, scale: float):
    """This split's share of the prefix keys `[start, start + count)` of `k_ref`, `v_ref [S, D]`: whole blocks
    unmasked, then one masked tail (keys at or past `length` are not read). Trip counts as int32 products: a
    `where` of two constants can lower to i1, which scf.for rejects."""
    split = pl.program_id(3)
    share = block_k * pl.cdiv(pl.cdiv(length, block_k), busy)
    start = split * share
    count = (split < busy).astype(jnp.int32) * jnp.clip(length - start, 0, share)

    def block(c, at, masked):
        if not masked:
            return _softmax_step(c, q, k_ref[pl.ds(at, block_k), :], v_ref[pl.ds(at, block_k), :], scale)
        inside = at + jnp.arange(block_k) < length
        keys = plgpu.load(k_ref.at[pl.ds(at, block_k)], mask=inside[:, None], other=0)
        values = plgpu.load(v_ref.at[pl.ds(at, block_k)], mask=inside[:, None], other=0)
        return _softmax_step(c, q, keys, values, scale, inside[None, :])

    carry = jax.lax.fori_loop(0, count // block_k, lambda i, c: block(c, start + i * block_k, False), carry)
    return jax.lax.fori_loop(0, (count % block_k > 0).astype(jnp.int32),
                             lambda i, c: block(c, start + count // block_k * block_k, True), carry)


def _tree_visible(ancestors_ref, nodes, i, block_t: int):
    """`[R_blk, block_t]`: the rows' (`nodes`) ancestor flags for tree keys `[i * block_t, (i + 1) * block_t)`."""
    n = ancestors_ref.shape[0]
    columns = i * block_t + jnp.arange(block_t)
    return plgpu.load(ancestors_ref.at[nodes[:, None], columns[None, :]], mask=columns[None, :] < n, other=0) != 0


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
    carry = _prefix_share(_empty_softmax(rows, d), q, k_ref, v_ref, length, busy, block_k=block_k, scale=scale)

    def tree_block(i, c):  # the tree's keys, read back from the cache where the model wrote them
        at = length + i * block_t
        inside = at + jnp.arange(block_t) < k_ref.shape[0]
        keys = plgpu.load(k_ref.at[pl.ds(at, block_t)], mask=inside[:, None], other=0)
        values = plgpu.load(v_ref.at[pl.ds(at, block_t)], mask=inside[:, None], other=0)
        return _softmax_step(c, q, keys, values, scale, _tree_visible(ancestors_ref, nodes, i, block_t) & inside)

    carry = jax.lax.fori_loop(0, (split == splits).astype(jnp.int32) * pl.cdiv(n, block_t), tree_block, carry)

    @pl.when((split < busy) | (split == splits))
    def _store():
        o_ref[...], m_ref[...], l_ref[...] = carry[0].astype(o_ref.dtype), carry[1], carry[2]


def _normed_rotated(qkv_ref, rope_ref, norm_ref, nodes, first_column, eps: float | None):
    """Heads of the fused projection's output as attention reads them: `qkv_ref [N, W]` at rows `nodes [R]` and
    columns `first_column [R] + [0, D)`, RMS-normed by `norm_ref [D]` (eps None: no norm)
    and rotated by `rope_ref [N, 2, D]` (cos and sin, each half repeated), rounded to qkv's dtype after each as
    the model's `rms_norm` and `apply_rope` round -> `[R, D]`. The rotation's other half is the same row read
    with its halves swapped."""
    d = rope_ref.shape[2]
    column = jnp.arange(d)
    swapped = (column + d // 2) % d
    x = plgpu.load(qkv_ref.at[nodes[:, None], first_column[:, None] + column[None, :]]).astype(jnp.float32)
    x_swapped = plgpu.load(qkv_ref.at[nodes[:, None], first_column[:, None] + swapped[None, :]]).astype(jnp.float32)
    if eps is not None:
        inverse = jax.lax.rsqrt((x * x).sum(axis=1) / d + eps)[:, None]
        x = (x * inverse * plgpu.load(norm_ref.at[column]).astype(jnp.float32)[None, :]).astype(qkv_ref.dtype)
        x_swapped = (x_swapped * inverse * plgpu.load(norm_ref.at[swapped]).astype(jnp.float32)[None, :]).astype(
            qkv_ref.dtype)
    cos = plgpu.load(rope_ref.at[nodes[:, None], 0, column[None, :]])
    sin = plgpu.load(rope_ref.at[nodes[:, None], 1, column[None, :]])
    sign = jnp.where(column < d // 2, -1.0, 1.0)[None, :]
    return (x.astype(jnp.float32) * cos + sign * x_swapped.astype(jnp.float32) * sin).astype(qkv_ref.dtype)


def _partials_from_qkv_kernel(len_ref, qkv_ref, rope_ref, q_norm_ref, k_norm_ref, k_ref, v_ref, ancestors_ref,
                              o_ref, m_ref, l_ref, k_out_ref, v_out_ref, *, splits: int, least: int, min_keys: int,
                              block_k: int, block_t: int, group: int, heads: int, kv_heads: int, scale: float,
                              eps: float | None):
    """`_partials_kernel` from the fused projection's output `qkv_ref [N, (H + 2 H_kv) D]`: each program norms and
    rotates its query rows; the tree split's programs its K/V head's new keys and values, and row block 0 of them
    writes those into the cache (`k_out_ref`, `v_out_ref`: `k_ref`, `v_ref` aliased; no prefix program reads those
    slots). Rows past the cache are neither written nor seen, as the model's `_write` drops them."""
    length, split, kv, writer = len_ref[...], pl.program_id(3), pl.program_id(1), pl.program_id(2) == 0
    busy = _busy_splits(length, splits, least, min_keys)
    n, d = ancestors_ref.shape[0], k_ref.shape[1]
    rows = m_ref.shape[0]
    nodes, q_rows = _query_rows(pl.program_id(2), rows, group, heads, n)
    q = _normed_rotated(qkv_ref, rope_ref, q_norm_ref, nodes, (q_rows - nodes * heads) * d, eps)
    carry = _prefix_share(_empty_softmax(rows, d), q, k_ref, v_ref, length, busy, block_k=block_k, scale=scale)

    def tree_block(i, c):  # the tree's keys from qkv, written to the cache once
        t = i * block_t + jnp.arange(block_t)
        fits = (t < n) & (length + t < k_ref.shape[0])
        source = jnp.minimum(t, n - 1)
        keys = _normed_rotated(qkv_ref, rope_ref, k_norm_ref, source,
                               jnp.full((block_t,), (heads + kv) * d, jnp.int32), eps)
        values = plgpu.load(qkv_ref.at[source[:, None], (heads + kv_heads + kv) * d + jnp.arange(d)[None, :]])

        @pl.when(writer)  # program ids read outside the loop: interpret mode replaces them only there
        def _write():
            slots = (length + t)[:, None], jnp.arange(d)[None, :]
            plgpu.store(k_out_ref.at[slots], keys.astype(k_out_ref.dtype), mask=fits[:, None])
            plgpu.store(v_out_ref.at[slots], values.astype(v_out_ref.dtype), mask=fits[:, None])

        keys, values = (jnp.where(fits[:, None], a, 0).astype(ref.dtype) for a, ref in ((keys, k_ref), (values, v_ref)))
        return _softmax_step(c, q, keys, values, scale, _tree_visible(ancestors_ref, nodes, i, block_t) & fits[None, :])

    carry = jax.lax.fori_loop(0, (split == splits).astype(jnp.int32) * pl.cdiv(n, block_t), tree_block, carry)

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


class _Plan(NamedTuple):
    """The launch shape both kernels share (chosen in `_plan`)."""
    block_r: int
    block_k: int
    block_t: int
    row_blocks: int
    splits: int
    least: int
    min_keys: int
    width: int
    columns: int
    merge_rows: int


def _plan(b, n, h, kv, d, s_len, block_r, block_k, splits, programs) -> _Plan:
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    rows = n * (h // kv)  # node-major (node, head) pairs of one K/V head, padded to the row block
    block_r = block_r or default_block_r(b, kv, rows, s_len, programs)
    block_r = min(pow2_at_least(block_r, 16), pow2_at_least(rows, 16))
    row_blocks = -(-rows // block_r)
    block_k = pow2_at_least(block_k, 16)
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
    return _Plan(block_r, block_k, min(block_k, pow2_at_least(n, 16)), row_blocks, splits, least, min_keys, width,
                 -(-(splits + 1) // width) * width,  # allocated; the merge reads the written ones
                 max(2, min(MERGE_ROWS, MERGE_TILE // (width * d), block_r)))


def _partial_outputs(plan: _Plan, b, kv, d, dtype):
    """The partials' BlockSpecs and shapes: (o, m, l) per (batch, K/V head, column, row)."""
    rows_padded = plan.row_blocks * plan.block_r
    specs = [pl.BlockSpec((None, None, None, plan.block_r, d), lambda i, k, j, c: (i, k, c, j, 0)),
             pl.BlockSpec((None, None, None, plan.block_r), lambda i, k, j, c: (i, k, c, j)),
             pl.BlockSpec((None, None, None, plan.block_r), lambda i, k, j, c: (i, k, c, j))]
    shapes = [jax.ShapeDtypeStruct((b, kv, plan.columns, rows_padded, d), dtype),
              jax.ShapeDtypeStruct((b, kv, plan.columns, rows_padded), jnp.float32),
              jax.ShapeDtypeStruct((b, kv, plan.columns, rows_padded), jnp.float32)]
    return specs, shapes


def _merge(plan: _Plan, lengths, partials, b, n, h, kv, d, dtype, interpret: bool, poison: bool):
    """The merge: many small programs, each writing its rows straight into the `[B, N, H, D]` output."""
    rows_padded = plan.row_blocks * plan.block_r
    merge_spec = lambda *tail: pl.BlockSpec((None, None, plan.columns, plan.merge_rows, *tail),  # noqa: E731
                                            lambda i, k, j: (i, k, 0, j, *(0 for _ in tail)))
    out = pallas_call(
        functools.partial(_merge_kernel, group=h // kv, nodes=n, width=plan.width, splits=plan.splits,
                          least=plan.least, min_keys=plan.min_keys), [lengths, *partials],
        grid=(b, kv, rows_padded // plan.merge_rows),
        in_specs=[pl.BlockSpec((None,), lambda i, k, j: (i,)), merge_spec(d), merge_spec(), merge_spec()],
        out_specs=pl.BlockSpec((None, n * h, d), lambda i, k, j: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, n * h, d), dtype),
        name="tree_attention_merge", num_warps=4, num_stages=3, interpret=interpret, poison=poison)
    return out.reshape(b, n, h, d)


def _partials_dtype(partials_dtype, dtype):
    return partials_dtype or (jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32)


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
    plan = _plan(b, n, h, kv, d, s_len, block_r, block_k, splits, programs)
    cache_spec = pl.BlockSpec((None, s_len, None, d), lambda i, k, j, c: (i, 0, k, 0))
    lengths = lengths.astype(jnp.int32)
    out_specs, out_shape = _partial_outputs(plan, b, kv, d, _partials_dtype(partials_dtype, q.dtype))
    partials = pallas_call(
        functools.partial(_partials_kernel, splits=plan.splits, least=plan.least, min_keys=plan.min_keys,
                          block_k=plan.block_k, block_t=plan.block_t, group=h // kv,
                          scale=math.log2(math.e) / math.sqrt(d)),
        # the kernels gather their (node, head) rows of q: no transposed copy; the int8 cast is a no-op for
        # the model, which passes its int8 table
        [lengths, q.reshape(b, n * h, d), k_cache, v_cache, ancestors.astype(jnp.int8)],
        grid=(b, kv, plan.row_blocks, plan.splits + 1),
        in_specs=[pl.BlockSpec((None,), lambda i, k, j, c: (i,)),
                  pl.BlockSpec((None, n * h, d), lambda i, k, j, c: (i, 0, 0)), cache_spec, cache_spec,
                  pl.BlockSpec((None, n, n), lambda i, k, j, c: (i, 0, 0))],
        out_specs=out_specs, out_shape=out_shape,
        name="tree_attention_partials", num_warps=num_warps, num_stages=num_stages, interpret=interpret, poison=poison)
    return _merge(plan, lengths, partials, b, n, h, kv, d, q.dtype, interpret, poison)


def rope_table(positions, inv_freq) -> jax.Array:
    """positions `[B, N]` -> `[B, N, 2, D]` float32: cos and sin of each position's angles, each half repeated
    (what `apply_rope` rotates by), for `tree_attention_from_qkv`."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    return jnp.stack([jnp.tile(jnp.cos(angles), 2), jnp.tile(jnp.sin(angles), 2)], axis=2)


def tree_attention_from_qkv_reference(qkv, rope, q_norm, k_norm, k_cache, v_cache, lengths, ancestors, *,
                                      heads: int, eps: float | None):
    """What the model does without the fused kernel: split qkv, norm, rotate, write the cache, attend."""
    from weaver_jax._model import _write, rms_norm

    b, n, _ = qkv.shape
    kv, d = k_cache.shape[2], k_cache.shape[3]
    q, k, v = jnp.split(qkv, [heads * d, (heads + kv) * d], axis=-1)
    q, k, v = q.reshape(b, n, heads, d), k.reshape(b, n, kv, d), v.reshape(b, n, kv, d)
    if eps is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos, sin = rope[:, :, None, 0, : d // 2], rope[:, :, None, 1, : d // 2]

    def rotate(x):
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

    k_cache, v_cache = _write(k_cache, rotate(k), lengths), _write(v_cache, v, lengths)
    return tree_attention_reference(rotate(q), k_cache, v_cache, lengths, ancestors), k_cache, v_cache


@functools.partial(jax.jit, static_argnames=("heads", "eps", "block_r", "block_k", "splits", "programs", "num_warps",
                                             "num_stages", "interpret", "poison"))
def tree_attention_from_qkv(qkv, rope, q_norm, k_norm, k_cache, v_cache, lengths, ancestors, *, heads: int,
                            eps: float | None, block_r: int | None = None, block_k: int = 64,
                            splits: int | None = None, programs: int = PROGRAMS, num_warps: int = 4,
                            num_stages: int = 2, interpret: bool = False, poison: bool = False):
    """`tree_attention` with what the model does between its qkv product and attention inside the partials kernel:
    qkv `[B, N, (H + 2 H_kv) D]` (q | k | v, bias added), rope `[B, N, 2, D]` (`rope_table`), q_norm, k_norm `[D]`
    (eps None: no q/k norm) -> (out `[B, N, H, D]`, k_cache, v_cache with the N new rows written at `[len, len +
    N)`; rows past the cache dropped). Saves the model's norm, rotation, slicing and cache-write launches (six a
    layer at the Qwen3 shapes). poison: the partials and output only (the caches are aliased in)."""
    b, n, _ = qkv.shape
    s_len, kv, d = k_cache.shape[1:]
    plan = _plan(b, n, heads, kv, d, s_len, block_r, block_k, splits, programs)
    if eps is None:  # unread
        q_norm = k_norm = jnp.ones((d,), qkv.dtype)
    cache_spec = pl.BlockSpec((None, s_len, None, d), lambda i, k, j, c: (i, 0, k, 0))
    lengths = lengths.astype(jnp.int32)
    out_specs, out_shape = _partial_outputs(plan, b, kv, d, _partials_dtype(None, qkv.dtype))
    vector = pl.BlockSpec((d,), lambda i, k, j, c: (0,))
    *partials, k_cache, v_cache = pallas_call(
        functools.partial(_partials_from_qkv_kernel, splits=plan.splits, least=plan.least, min_keys=plan.min_keys,
                          block_k=plan.block_k, block_t=plan.block_t, group=heads // kv, heads=heads, kv_heads=kv,
                          scale=math.log2(math.e) / math.sqrt(d), eps=eps),
        [lengths, qkv, rope.astype(jnp.float32), q_norm, k_norm, k_cache, v_cache, ancestors.astype(jnp.int8)],
        grid=(b, kv, plan.row_blocks, plan.splits + 1),
        in_specs=[pl.BlockSpec((None,), lambda i, k, j, c: (i,)),
                  pl.BlockSpec((None, n, qkv.shape[2]), lambda i, k, j, c: (i, 0, 0)),
                  pl.BlockSpec((None, n, 2, d), lambda i, k, j, c: (i, 0, 0, 0)), vector, vector,
                  cache_spec, cache_spec, pl.BlockSpec((None, n, n), lambda i, k, j, c: (i, 0, 0))],
        out_specs=[*out_specs, cache_spec, cache_spec],
        out_shape=[*out_shape, jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        aliases={5: 3, 6: 4}, name="tree_attention_partials", num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, poison=poison)
    return _merge(plan, lengths, partials, b, n, heads, kv, d, qkv.dtype, interpret, poison), k_cache, v_cache
