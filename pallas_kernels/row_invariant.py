"""Row-invariant matrix products and attention: the target's exact mode.

XLA picks a product's tiling (and split-K) from its shape, so a one-token decode step and a 64-node
verification reduce the same row in different orders; in bfloat16 a near-tie between the top two
logits then flips, and a speculative method stops matching `ar` token for token. These kernels fix
each row's reduction order by what the row itself is, never by how many rows come with it:

  matmul: x `[M, K]` times w (`[K, N]`, or `[N, K]` with `transpose_w`) in float32. One program per
    (16-row block, block of columns, piece of K) accumulates its piece block by block, in order, and the
    pieces' sums are added in index order; M is cut into blocks of 16 rows (the last one masked), so every row
    goes through the same programs whatever M is (a decode step's single row included). How many pieces K is cut into
    (`k_pieces`) follows from the weight's shape alone, never the rows: enough programs to fill the GPU
    where a weight has few output columns (SmolLM2's 576: 9 column blocks, of 132 SMs).
  attention: one program per (sequence, token, query head) walks the positions `0 ..` its own in
    64-wide blocks with an online softmax. The key at position p is read from slot p below the
    committed length and, from there on, from the slot of the new token at that position on the
    token's own path (`path [B, T, T]`, `weaver_jax._model.position_path`), so a decode step, a
    prefill and a tree verification read the same keys in the same order (and as many blocks: those
    up to its own position). With `Tiling.attention_split` the positions are cut at fixed absolute
    multiples of it, a program per piece, and the pieces' softmax states merged in index order (pieces
    past a token's position are empty and skipped): flash-decoding whose splits depend on the position
    alone, so a long context fills the GPU and a token's value still does not depend on the others.

The references are the plain XLA product and masked softmax: equal up to rounding, not bitwise.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from weaver_jax._model import gqa_attention
from weaver_jax.pallas_kernels import MASKED_SCORE
from weaver_jax.pallas_kernels._call import pallas_call

BLOCK_M = 16
BLOCK_P = 64  # positions per attention step


class Tiling(NamedTuple):
    """The product's launch: output columns and K per block, Triton's pipeline stages and warps, and the programs
    per 16 rows that K is cut into pieces to reach (about two per SM of an H200); the attention's pieces of
    positions. A function of the weight's shape at most, never of the rows: any tiling keeps rows invariant
    (a row's reduction order is the tiling's). Three pipeline stages: an exact decode step 1.05x the default
    step at the Qwen3.6-27B shape, against 1.15x with two; 1.83x against 1.90x at SmolLM2's (H100, BENCHMARKS).
    Attention in pieces of 128 positions: SmolLM2's exact step (1K context) 0.97x the default step against 1.99x
    with one walk per token at B = 1, 1.12x against 1.99x at B = 8; pieces of 64 no faster, 256 and 512 slower
    (H200, BENCHMARKS)."""

    block_n: int = 64
    block_k: int = 64
    stages: int = 3
    warps: int = 4
    programs: int = 256
    attention_split: int = 128  # positions per attention piece, a multiple of BLOCK_P (0: one walk per token)


TILING = Tiling()


def k_pieces(k_blocks: int, n_blocks: int, programs: int = TILING.programs) -> int:
    """How many pieces the product's K (`k_blocks` blocks) is cut into, from the weight's shape alone: the
    fewest (a divisor of k_blocks, each piece two blocks or more) that give `programs` column-block programs,
    or as many as there can be."""
    pieces = [d for d in range(1, k_blocks + 1) if k_blocks % d == 0 and (k_blocks // d >= 2 or d == 1)]
    return next((d for d in pieces if d * n_blocks >= programs), pieces[-1])


def matmul_reference(x, w, *, transpose_w: bool = False):
    return jnp.einsum("mk,nk->mn" if transpose_w else "mk,kn->mn", x, w, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)


def _matmul_kernel(x_ref, w_ref, o_ref, *, transpose_w: bool, precision, steps: int, block_n: int, block_k: int,
                   shape: tuple[int, int, int]):
    """One (row block, column block, piece of K): x_ref / o_ref the block's `[BLOCK_M, K]` / `[BLOCK_M, N]`,
    w_ref the whole weight; the piece's `steps` blocks of block_k, in order. shape: (M, K, N); what the last
    blocks hold past them is read as zeros (a zero product changes no sum) and not written."""
    m, k, n = shape
    columns = pl.ds(pl.program_id(1) * block_n, block_n)
    first = pl.program_id(2) * steps
    present = (pl.program_id(0) * BLOCK_M + jnp.arange(BLOCK_M) < m)[:, None]
    in_n = (pl.program_id(1) * block_n + jnp.arange(block_n) < n) if n % block_n else None  # None: all are

    def step(i, acc):
        depth = pl.ds((first + i) * block_k, block_k)
        in_k = ((first + i) * block_k + jnp.arange(block_k) < k) if k % block_k else None
        x = plgpu.load(x_ref.at[:, depth], mask=_all(present, _along(in_k, 1)), other=0)
        if transpose_w:
            block, w_mask = w_ref.at[columns, depth], _all(_along(in_n, 0), _along(in_k, 1))
        else:
            block, w_mask = w_ref.at[depth, columns], _all(_along(in_k, 0), _along(in_n, 1))
        w = block[...] if w_mask is None else plgpu.load(block, mask=w_mask, other=0)
        return acc + plgpu.dot(x, w, trans_b=transpose_w, precision=precision)

    out = jax.lax.fori_loop(0, steps, step, jnp.zeros((BLOCK_M, block_n), jnp.float32))
    plgpu.store(o_ref.at[:, :], out, mask=_all(present, _along(in_n, 1)))


def _along(mask, axis: int):
    """A vector mask as a column (axis 0) or a row (axis 1) of a 2-D block; None (nothing masked) stays None."""
    return None if mask is None else mask[:, None] if axis == 0 else mask[None, :]


def _all(*masks):
    """The masks' conjunction, broadcast; None where every one is None (a load or store that needs none)."""
    masks = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, masks) if masks else None


def matmul(x, w, *, transpose_w: bool = False, tiling: Tiling | None = None, interpret: bool = False,
           poison: bool = False):
    """x `[..., K]` @ w `[K, N]` (transpose_w: w `[N, K]`) -> `[..., N]` float32, each row's value
    independent of the other rows (see the module docstring); tiling: the launch (default: `TILING` as it is
    at the call). float32 operands multiply at full precision."""
    return _matmul(x, w, transpose_w=transpose_w, tiling=TILING if tiling is None else tiling, interpret=interpret,
                   poison=poison)


@functools.partial(jax.jit, static_argnames=("transpose_w", "tiling", "interpret", "poison"))
def _matmul(x, w, *, transpose_w: bool, tiling: Tiling, interpret: bool, poison: bool):
    *lead, k = x.shape
    n, w_k = (w.shape[0], w.shape[1]) if transpose_w else (w.shape[1], w.shape[0])
    if w_k != k:
        raise ValueError(f"x has {k} columns but the weight's inner dimension is {w_k}")
    bn, bk = tiling.block_n, tiling.block_k
    # nothing is padded (the kernel masks its last blocks): a pad of the rows to 16 was fused with the norm
    # before it, which XLA recomputed for every element of the pad (27B exact step: 6.7 of 31 ms)
    rows = x.reshape(-1, k)
    m, n_blocks, k_blocks = rows.shape[0], pl.cdiv(n, bn), pl.cdiv(k, bk)
    pieces = k_pieces(k_blocks, n_blocks, tiling.programs)
    precision = jax.lax.Precision.HIGHEST if jnp.promote_types(x.dtype, w.dtype) == jnp.float32 else None
    sums = pallas_call(
        functools.partial(_matmul_kernel, transpose_w=transpose_w, precision=precision, steps=k_blocks // pieces,
                          block_n=bn, block_k=bk, shape=(m, k, n)),
        [rows, w], grid=(pl.cdiv(m, BLOCK_M), n_blocks, pieces),
        in_specs=[pl.BlockSpec((BLOCK_M, k), lambda i, j, p: (i, 0)), pl.BlockSpec()],
        out_specs=pl.BlockSpec((None, BLOCK_M, bn), lambda i, j, p: (p, i, j)),
        out_shape=jax.ShapeDtypeStruct((pieces, m, n), jnp.float32),
        name="row_invariant_matmul", num_warps=tiling.warps, num_stages=tiling.stages, interpret=interpret,
        poison=poison)
    out = functools.reduce(jnp.add, list(sums))  # the pieces in index order: elementwise, so still per row
    return out.reshape(*lead, n)


def attention_reference(q, k_cache, v_cache, positions, lengths, path):
    """The same attention as a masked softmax over all S slots: q `[B, T, H, D]`, cache `[B, S, H_kv, D]`."""
    b, t, h, d = q.shape
    kv = k_cache.shape[2]
    seen = jnp.zeros((b, t, k_cache.shape[1]), bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None],
        jnp.where(path >= 0, lengths[:, None, None] + path, k_cache.shape[1])].set(True, mode="drop")
    mask = seen | (jnp.arange(k_cache.shape[1])[None, None, :] < lengths[:, None, None])
    return gqa_attention(q.reshape(b, t, kv, h // kv, d), k_cache, v_cache, mask).reshape(b, t, h, d)


def _attention_kernel(len_ref, pos_ref, path_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, group: int,
                      scale: float, piece_blocks: int):
    """One (sequence, token, query head, piece of positions): q_ref `[D]`, k_ref / v_ref `[S, H_kv, D]`, path_ref
    `[T]` -> the piece's unnormalised output o_ref `[D]`, its running max m_ref and sum l_ref (0: an empty piece)."""
    length, position = len_ref[...], pos_ref[...]
    d, new = q_ref.shape[0], path_ref.shape[0]
    head = pl.program_id(2) // group
    q = q_ref[...].astype(jnp.float32)

    def step(i, carry):
        o, m, total = carry
        at = i * BLOCK_P + jnp.arange(BLOCK_P)  # positions
        depth = at - length
        on_path = (depth >= 0) & (depth < new)
        node = plgpu.load(path_ref.at[jnp.clip(depth, 0, new - 1)], mask=on_path, other=-1)
        visible = (at <= position) & ((depth < 0) | (node >= 0))
        slots = jnp.where(depth < 0, at, length + node)
        rows = (jnp.where(visible, slots, 0)[:, None], head, jnp.arange(d)[None, :])
        mask = jnp.broadcast_to(visible[:, None], (BLOCK_P, d))
        keys = plgpu.load(k_ref.at[rows], mask=mask, other=0).astype(jnp.float32)  # [P, D]
        s = jnp.where(visible, jnp.sum(keys * q[None, :], axis=1) * scale, MASKED_SCORE)
        m_new = jnp.maximum(m, jnp.max(s))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        correction = jnp.exp(m - m_new)
        values = plgpu.load(v_ref.at[rows], mask=mask, other=0).astype(jnp.float32)
        return o * correction + jnp.sum(p[:, None] * values, axis=0), m_new, total * correction + jnp.sum(p)

    init = jnp.zeros((d,), jnp.float32), jnp.float32(MASKED_SCORE), jnp.float32(0)
    first = pl.program_id(3) * piece_blocks
    last = jnp.minimum(position // BLOCK_P + 1, first + piece_blocks)
    o, m, total = jax.lax.fori_loop(first, last, step, init)  # last <= first: an empty piece, no step
    o_ref[...], m_ref[...], l_ref[...] = o, m, total


def merge_pieces(o, m, total):
    """The pieces' softmax states `[P, ...]` (o with a trailing D) merged in index order -> `[..., D]`. An empty
    piece (total 0) is skipped, not merged: a token's value is the same bits whatever number of empty pieces the
    cache's size gives it; one piece is `o / total`, the single walk's division. The running maxima come first
    (exact in any order), so the unrolled chain left is one multiply-add per piece: a chain that also carried the
    max compiled in time growing faster than P (on a CPU 5 s at 64 pieces, 77 s at 256; now 0.5 s and 2.8 s)."""
    empty = total == 0
    running = jax.lax.cummax(jnp.where(empty, -jnp.inf, m), axis=0)  # the merged max after each piece
    before = jnp.concatenate([running[:1], running[:-1]])
    keep = jnp.where(running == before, 1.0, jnp.exp(before - running))  # exactly 1 where the max stays
    take = jnp.exp(m - running)
    out_o, out_l = o[0], total[0]
    for p in range(1, o.shape[0]):
        out_o = jnp.where(empty[p][..., None], out_o, out_o * keep[p][..., None] + o[p] * take[p][..., None])
        out_l = jnp.where(empty[p], out_l, out_l * keep[p] + total[p] * take[p])
    return out_o / out_l[..., None]


def attention(q, k_cache, v_cache, positions, lengths, path, *, split: int | None = None, interpret: bool = False,
              poison: bool = False):
    """Attention of new tokens q `[B, T, H, D]` (after RoPE; their K/V already written at slots
    `[lengths, lengths + T)` of k_cache / v_cache `[B, S, H_kv, D]`) over the committed prefix and
    the new tokens on their path: positions `[B, T]`, lengths `[B]`, path `[B, T, T]`
    (`weaver_jax._model.position_path`); D a power of two; split: positions per piece (default:
    `TILING.attention_split` as it is at the call; 0: one walk). -> `[B, T, H, D]` float32, each token's
    value independent of the others."""
    return _attention(q, k_cache, v_cache, positions, lengths, path,
                      split=TILING.attention_split if split is None else split, interpret=interpret, poison=poison)


@functools.partial(jax.jit, static_argnames=("split", "interpret", "poison"))
def _attention(q, k_cache, v_cache, positions, lengths, path, *, split: int, interpret: bool, poison: bool):
    b, t, h, d = q.shape
    s = k_cache.shape[1]
    kv = k_cache.shape[2]
    if split % BLOCK_P or split < 0:
        raise ValueError(f"attention_split must be a multiple of {BLOCK_P} (0: one walk), got {split}")
    if h % kv:
        raise ValueError(f"{h} query heads do not group over {kv} K/V heads")
    if d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two")
    if path.shape != (b, t, t):
        raise ValueError(f"path must be [B, T, T] = {(b, t, t)}, got {path.shape}")
    piece_blocks = split // BLOCK_P if split else pl.cdiv(s, BLOCK_P)
    pieces = pl.cdiv(pl.cdiv(s, BLOCK_P), piece_blocks)
    one = pl.BlockSpec((None, None, None, d), lambda i, j, k, p: (i, j, k, 0))
    cache = pl.BlockSpec((None, s, kv, d), lambda i, j, k, p: (i, 0, 0, 0))
    in_specs = [pl.BlockSpec((None,), lambda i, j, k, p: (i,)), pl.BlockSpec((None, None), lambda i, j, k, p: (i, j)),
                pl.BlockSpec((None, None, t), lambda i, j, k, p: (i, j, 0)), one, cache, cache]
    state = pl.BlockSpec((None, None, None, None), lambda i, j, k, p: (p, i, j, k))
    o, m, total = pallas_call(
        functools.partial(_attention_kernel, group=h // kv, scale=1 / math.sqrt(d), piece_blocks=piece_blocks),
        [lengths.astype(jnp.int32), positions.astype(jnp.int32), path.astype(jnp.int32), q, k_cache, v_cache],
        grid=(b, t, h, pieces), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, None, d), lambda i, j, k, p: (p, i, j, k, 0)), state, state],
        out_shape=[jax.ShapeDtypeStruct((pieces, b, t, h, d), jnp.float32),
                   *(jax.ShapeDtypeStruct((pieces, b, t, h), jnp.float32) for _ in range(2))],
        name="row_invariant_attention", num_warps=4, num_stages=1, interpret=interpret, poison=poison)
    return merge_pieces(o, m, total)
