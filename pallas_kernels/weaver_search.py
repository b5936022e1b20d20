"""The Weaver tree search (DESIGN 3.4) as two Pallas Triton kernels per adapter call.

In XLA one call of the batched best-first search is ~50 small kernels (the frontier's top-w, the
node step's norms, projections, RoPE, attention and MLP for every adapter block, the pool scoring,
its softmax and top-c, the scatters of the bookkeeping): latency, not work, at the SmolLM2 adapter's
size (BENCHMARKS.md). Here a call is two launches:

  expand (grid: batch): take the frontier's best `w` entries (argmax w times, the lowest slot first
    among equal scores, as `lax.top_k`), materialise them as nodes (tree arrays, node scores, rows of
    the ancestor table), and run their node step through every adapter block: token-table rows in,
    RMSNorm, q/k/v with RoPE (kept as two halves of each head, so no register shuffles), attention
    over the prefix, the node's strict ancestors (the tree's slots under the ancestor row) and
    itself, the SwiGLU MLP in column blocks, the output norm -> the nodes' states u `[W, d]`; their
    K/V go to the adapter cache;
  children (grid: batch x w): one new node's pool (the drafter's top-P at the node's next depth)
    scored by u against the candidate table's rows, normalised over the pool, its top-c children
    published into the frontier with cumulative log-probabilities (-inf at the adapter's max depth).

One program holds a sequence's node step, streaming every adapter weight once per call, so this
serves small adapters (`fits`); larger ones keep the XLA search. All state lives in memory and is
updated in place (aliased): a tree is the prefix and the pool in XLA, then 1 + `search_calls`
pairs of launches. `weaver_search_reference` is `_adapter.weaver_tree`'s XLA search, which must
build the same tree (up to rounding at near ties: activations stay float32 here between products).

Layouts (padded to powers of two; padding is never selected, and lanes without a node write
distinct padding entries): tree `[B, 4, N_p]` int32 rows tokens, parent, depth, valid; node scores
`[B, N_p]`; ancestors `[B, N_p, N_p]` int8 (a node and its ancestors); frontier scores and tokens
`[B, F_p]`, the root owning slots `[0, R_p)` (its `root_children`) and node i >= 1 slots
`[R_p + (i - 1) * C_p, ... + c)` (R_p, C_p: the root's and a node's children rounded up to a power of
two; the rest stay -inf, and slot order is still node then rank, as `lax.top_k` breaks ties); count `[B]`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from weaver_jax._model import KVCache, rope_frequencies
from weaver_jax._tree import Tree, round_loop, search_calls
from weaver_jax.pallas_kernels import MASKED_SCORE
from weaver_jax.pallas_kernels._call import pallas_call, pick, pow2_at_least

MAX_WIDTH = 512  # adapter widths (d_rank) one program's registers hold; wider adapters keep the XLA search
MAX_WEIGHTS = 1 << 22  # adapter block parameters one program streams per call (8 MB in bfloat16) at most
MLP_BLOCK = 64  # MLP columns per step
POOL_CHUNK = 32  # candidate-table columns per step of the pool scoring
LAYER_REFS = 10  # weights per adapter block (`_layer_weights`)


def fits(config) -> bool:
    """Whether an adapter (`AdapterConfig`) takes the kernels: head halves a power of two >= 16 (the
    Triton dot's smallest side), width and weights within one program's reach."""
    half = config.d_rank // config.num_heads // 2
    weights = config.num_layers * (4 * config.d_rank**2 + 3 * config.d_rank * config.mlp_dim)
    return half >= 16 and not half & (half - 1) and config.d_rank <= MAX_WIDTH and weights <= MAX_WEIGHTS


def _vector(ref, index, inside, other=0):
    return plgpu.load(ref.at[index], mask=inside, other=other)


def _tile(ref, rows, cols, row_inside=None, col_inside=None):
    """`ref[rows, cols]` as a `[len(rows), len(cols)]` tile, zero where a row or column is outside."""
    row_inside = jnp.ones(rows.shape, jnp.bool_) if row_inside is None else row_inside
    col_inside = jnp.ones(cols.shape, jnp.bool_) if col_inside is None else col_inside
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=row_inside[:, None] & col_inside[None, :], other=0)


def _rows(cache, b, slots, head, cols):
    """The index of `cache[b, slots, head, cols]` for a `[len(slots), len(cols)]` load or store."""
    return cache.at[b, slots[:, None], head, cols[None, :]]


def _rms(x, scale_ref, bias_ref, d: int, eps: float):
    """RMSNorm of float32 rows `x [R, D_p]` (zeros past d) with scale and bias `[d]`; zeros past d."""
    cols = jnp.arange(x.shape[1])
    inside = cols < d
    scale = _vector(scale_ref, cols, inside).astype(jnp.float32)
    bias = _vector(bias_ref, cols, inside).astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)[:, None]
    return jnp.where(inside[None, :], y * scale[None, :] + bias[None, :], 0.0)


def _dot(a, b, trans_b: bool = False):
    return plgpu.dot(a, b.astype(a.dtype), trans_b=trans_b)


def _select(values_ref, tokens_ref, tree_ref, count, w: int, c_p: int, r_p: int, n: int, lane):
    """The frontier's best w entries, best first (the lowest slot among equal scores):
    -> (score, slot, node, ok, parent, token, depth), each `[W_p]`."""
    values = values_ref[...]
    f_p, n_p = values.shape[0], tree_ref.shape[1]
    slots = jnp.arange(f_p)
    score, slot = jnp.full(lane.shape, -jnp.inf), jnp.zeros(lane.shape, jnp.int32)
    for j in range(w):
        best = jnp.max(values)
        at = jnp.min(jnp.where(values == best, slots, f_p)).astype(jnp.int32)
        score, slot = jnp.where(lane == j, best, score), jnp.where(lane == j, at, slot)
        values = jnp.where(slots == at, -jnp.inf, values)
    node = count + lane
    ok = (score > -jnp.inf) & (node < n) & (lane < w)
    slot = jnp.where(ok, slot, f_p - lane.shape[0] + lane)
    parent = jnp.where(ok & (slot >= r_p), (slot - r_p) // c_p + 1, 0)
    token = plgpu.load(tokens_ref.at[slot], mask=ok, other=0)
    depth = jnp.sum(jnp.where(jnp.arange(n_p)[None, :] == parent[:, None], tree_ref[2][None, :], 0), axis=1) + 1
    return score, slot, jnp.where(ok, node, n_p - lane.shape[0] + lane), ok, parent, token, depth


def _expand_kernel(count_ref, values_ref, tokens_ref, tree_ref, score_ref, anc_ref, token_table_ref, inv_freq_ref,
                   out_norm_ref, out_bias_ref, *refs, root_call: bool, w: int, c_p: int, r_p: int, n: int,
                   prefix_len: int, layers: int, heads: int, d: int, mlp: int, eps: float):
    """One sequence: select w frontier entries (the root, on the first call), make them nodes, run
    their node step. refs: each layer's weights (`_layer_weights`), the caches (k per layer, then v),
    then the outputs: count, frontier scores, tree, node scores, ancestors, caches (all aliased to
    their inputs; the frontier tokens are only read), u `[W_p, D_p]`, nodes `[W_p]` (-1: none)."""
    weights = [refs[LAYER_REFS * i:LAYER_REFS * (i + 1)] for i in range(layers)]
    refs = refs[LAYER_REFS * layers:]
    caches, (count_out, values_out, tree_out, score_out, anc_out) = refs[:2 * layers], refs[2 * layers:2 * layers + 5]
    cache_outs, (u_ref, nodes_ref) = refs[2 * layers + 5:4 * layers + 5], refs[4 * layers + 5:]
    b = pl.program_id(0)
    w_p, d_p = u_ref.shape
    n_p = score_ref.shape[0]
    lane, node_index = jnp.arange(w_p), jnp.arange(n_p)
    dtype = caches[0].dtype

    if root_call:  # the root (node 0) is in the tree already: expand it alone
        ok = lane == 0
        nodes = jnp.where(ok, 0, n_p - w_p + lane)
        token = jnp.where(ok, pick(tree_ref[0], node_index, 0), 0)
        depth = jnp.zeros((w_p,), jnp.int32)
        strict = jnp.zeros((w_p, n_p), jnp.bool_)
    else:
        count = count_ref[...]
        score, slot, nodes, ok, parent, token, depth = _select(values_ref, tokens_ref, tree_ref, count, w, c_p, r_p, n,
                                                               lane)
        plgpu.store(values_out.at[slot], jnp.full((w_p,), -jnp.inf), mask=ok)
        for row, value in enumerate((token, parent, depth, ok.astype(jnp.int32))):
            plgpu.store(tree_out.at[row, nodes], value, mask=ok)
        plgpu.store(score_out.at[nodes], score, mask=ok)
        count_out[...] = count + jnp.sum(ok.astype(jnp.int32))
        strict = _tile(anc_ref, parent, node_index, ok) != 0  # the parent's row: the node's strict ancestors
    own = strict | (node_index[None, :] == nodes[:, None])
    plgpu.store(anc_out.at[nodes[:, None], node_index[None, :]], own.astype(anc_out.dtype),
                mask=jnp.broadcast_to(ok[:, None], own.shape))
    nodes_ref[...] = jnp.where(ok, nodes, -1)

    cols = jnp.arange(d_p)
    col_in = cols < d
    x = _tile(token_table_ref, token, cols, ok, col_in).astype(jnp.float32)  # [W_p, D_p], zero past d
    dh = d // heads
    half = dh // 2
    angles = (depth + 1).astype(jnp.float32)[:, None] * inv_freq_ref[...][None, :]  # nodes sit at depth + 1
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    prefix = jnp.arange(pow2_at_least(prefix_len, 16))
    prefix_in = prefix < prefix_len
    slot = prefix_len + nodes
    scale = 1 / math.sqrt(dh)
    for layer in range(layers):
        attn_norm, attn_bias, qkv, out, mlp_norm, mlp_bias, gate_up, gate_up_bias, down, down_bias = weights[layer]
        k_cache, v_cache = caches[layer], caches[layers + layer]
        h = _rms(x, attn_norm, attn_bias, d, eps).astype(dtype)
        attn = jnp.zeros((w_p, d_p), jnp.float32)
        for head in range(heads):
            base = head * dh

            def proj(offset, width, h=h, qkv=qkv):
                return _dot(h, _tile(qkv, cols, offset + jnp.arange(width), col_in))

            def keys(cache, slots, inside, part, width, head=head):  # rows of one head's K or V
                return plgpu.load(_rows(cache, b, slots, head, part + jnp.arange(width)),
                                  mask=jnp.broadcast_to(inside[:, None], (slots.shape[0], width)), other=0)

            q1, q2, k1, k2 = (proj(part * d + base + second * half, half) for part in (0, 1) for second in (0, 1))
            v = proj(2 * d + base, dh).astype(dtype)
            q1, q2 = (q1 * cos - q2 * sin).astype(dtype), (q2 * cos + q1 * sin).astype(dtype)
            k1, k2 = (k1 * cos - k2 * sin).astype(dtype), (k2 * cos + k1 * sin).astype(dtype)
            for cache_out, part, value in ((cache_outs[layer], 0, k1), (cache_outs[layer], half, k2),
                                           (cache_outs[layers + layer], 0, v)):
                plgpu.store(_rows(cache_out, b, slot, head, part + jnp.arange(value.shape[1])), value,
                            mask=jnp.broadcast_to(ok[:, None], value.shape))
            tree_in = node_index >= 0
            s_prefix = (_dot(q1, keys(k_cache, prefix, prefix_in, 0, half), trans_b=True)
                        + _dot(q2, keys(k_cache, prefix, prefix_in, half, half), trans_b=True)) * scale
            s_tree = (_dot(q1, keys(k_cache, prefix_len + node_index, tree_in, 0, half), trans_b=True)
                      + _dot(q2, keys(k_cache, prefix_len + node_index, tree_in, half, half), trans_b=True)) * scale
            s_self = jnp.sum(q1.astype(jnp.float32) * k1.astype(jnp.float32)
                             + q2.astype(jnp.float32) * k2.astype(jnp.float32), axis=1) * scale
            s_prefix = jnp.where(prefix_in[None, :], s_prefix, MASKED_SCORE)
            s_tree = jnp.where(strict, s_tree, MASKED_SCORE)
            m = jnp.maximum(jnp.maximum(s_prefix.max(axis=1), s_tree.max(axis=1)), s_self)
            p_prefix, p_tree, p_self = jnp.exp(s_prefix - m[:, None]), jnp.exp(s_tree - m[:, None]), jnp.exp(s_self - m)
            total = p_prefix.sum(axis=1) + p_tree.sum(axis=1) + p_self
            o = (_dot(p_prefix.astype(dtype), keys(v_cache, prefix, prefix_in, 0, dh))
                 + _dot(p_tree.astype(dtype), keys(v_cache, prefix_len + node_index, tree_in, 0, dh))
                 + p_self[:, None] * v.astype(jnp.float32)) / total[:, None]
            attn += _dot(o.astype(dtype), _tile(out, base + jnp.arange(dh), cols, col_inside=col_in))
        x = x + attn
        h = _rms(x, mlp_norm, mlp_bias, d, eps).astype(dtype)

        def mlp_block(i, y, h=h, gate_up=gate_up, gate_up_bias=gate_up_bias, down=down):
            columns = i * MLP_BLOCK + jnp.arange(MLP_BLOCK)
            inside = columns < mlp
            gate = _dot(h, _tile(gate_up, cols, columns, col_in, inside))
            up = _dot(h, _tile(gate_up, cols, mlp + columns, col_in, inside))
            gate = gate + _vector(gate_up_bias, columns, inside).astype(jnp.float32)[None, :]
            up = up + _vector(gate_up_bias, mlp + columns, inside).astype(jnp.float32)[None, :]
            act = (jax.nn.silu(gate) * up).astype(dtype)
            return y + _dot(act, _tile(down, columns, cols, inside, col_in))

        y = jax.lax.fori_loop(0, pl.cdiv(mlp, MLP_BLOCK), mlp_block, jnp.zeros((w_p, d_p), jnp.float32))
        x = x + y + _vector(down_bias, cols, col_in).astype(jnp.float32)[None, :]
    u_ref[...] = _rms(x, out_norm_ref, out_bias_ref, d, eps)


def _children_kernel(nodes_ref, u_ref, tree_ref, score_ref, pool_ids_ref, pool_logits_ref, candidate_ref, values_ref,
                     tokens_ref, values_out, tokens_out, *, c: int, c_p: int, r_p: int, max_depth: int, d: int,
                     pool: int):
    """One new node (a lane of one sequence): its pool scored by u, normalised, the top c published
    (the root's call: c, c_p are the root's children)."""
    del values_ref, tokens_ref  # aliased to the outputs: only written, at this node's own slots
    b, node = pl.program_id(0), nodes_ref[...]

    @pl.when(node >= 0)
    def _publish():
        index = jnp.arange(score_ref.shape[0])
        depth = pick(tree_ref[2], index, node)
        row = jnp.minimum(depth, pool_ids_ref.shape[1] - 1)  # pool row t is depth t + 1: a node at depth t reads row t
        lanes = jnp.arange(pool_ids_ref.shape[2])
        inside = lanes < pool
        ids = plgpu.load(pool_ids_ref.at[b, row, lanes], mask=inside, other=0)
        logits = plgpu.load(pool_logits_ref.at[b, row, lanes], mask=inside, other=0.0)
        dtype = candidate_ref.dtype
        for start in range(0, d, POOL_CHUNK):
            cols = start + jnp.arange(POOL_CHUNK)
            col_in = cols < d
            u = _vector(u_ref, cols, col_in).astype(dtype).astype(jnp.float32)
            logits += jnp.sum(_tile(candidate_ref, ids, cols, inside, col_in).astype(jnp.float32) * u[None, :], axis=1)
        logits = jnp.where(inside, logits, -jnp.inf)
        m = jnp.max(logits)
        logp = logits - (m + jnp.log(jnp.sum(jnp.exp(logits - m))))
        rank = jnp.arange(c_p)
        values, tokens = jnp.full((c_p,), -jnp.inf), jnp.zeros((c_p,), jnp.int32)
        for j in range(c):
            best = jnp.max(logp)
            at = jnp.min(jnp.where(logp == best, lanes, lanes.shape[0]))
            values, tokens = jnp.where(rank == j, best, values), jnp.where(rank == j, pick(ids, lanes, at), tokens)
            logp = jnp.where(lanes == at, -jnp.inf, logp)
        alive = (rank < c) & (depth < max_depth)
        slots = jnp.where(node == 0, 0, r_p + (node - 1) * c_p) + rank
        plgpu.store(values_out.at[slots], jnp.where(alive, pick(score_ref[...], index, node) + values, -jnp.inf))
        plgpu.store(tokens_out.at[slots], tokens)


def _layer_weights(adapter) -> list:
    return [p[...] for layer in adapter.layers for p in (
        layer.attn_norm, layer.attn_norm_bias, layer.attn.qkv, layer.attn.out, layer.mlp_norm, layer.mlp_norm_bias,
        layer.mlp.gate_up, layer.mlp.gate_up_bias, layer.mlp.down, layer.mlp.down_bias)]


def cache_size(prefix_len: int, budget: int, expansions: int) -> int:
    """Adapter cache slots `weaver_search` needs: the prefix, then one slot per (padded) node."""
    return prefix_len + pow2_at_least(budget + 1 + pow2_at_least(expansions, 16))


def weaver_search(adapter, tables, cache: KVCache, root, pool_ids, pool_logits, *, budget: int, children: int,
                  expansions: int, max_depth: int, prefix_len: int, root_children: int | None = None,
                  interpret: bool = False, num_warps: int = 4, num_stages: int = 1) -> Tree:
    """`_tree.batched_best_first` with the adapter's scorer (`_adapter.adapter_children`), in the
    kernels. adapter, tables: the `Adapter` and its `Tables`; cache: its K/V with the round's prefix
    in slots `[0, prefix_len)` and `cache_size(...)` slots (lengths unused); root `[B]`; pool_ids,
    pool_logits `[B, max_depth, P]` (the drafter's top-P per depth). -> a `Tree` of `budget + 1` nodes."""
    config = adapter.config
    b, k, pool = pool_ids.shape
    n, c, w = budget + 1, children, expansions
    r = c if root_children is None else root_children
    c_p, r_p, w_p = pow2_at_least(c), pow2_at_least(r), pow2_at_least(w, 16)
    n_p = pow2_at_least(n + w_p)
    f_p = pow2_at_least(r_p + budget * c_p + w_p)
    slots = cache_size(prefix_len, budget, expansions)
    if cache.size < slots:
        raise ValueError(f"the adapter cache needs {slots} slots, got {cache.size}")
    d, d_p = config.d_rank, pow2_at_least(config.d_rank, 16)
    tree = jnp.zeros((b, 4, n_p), jnp.int32).at[:, 0, 0].set(root).at[:, 1].set(-1).at[:, 3, 0].set(1)
    state = (jnp.ones((b,), jnp.int32), jnp.full((b, f_p), -jnp.inf), jnp.zeros((b, f_p), jnp.int32), tree,
             jnp.zeros((b, n_p), jnp.float32), jnp.zeros((b, n_p, n_p), jnp.int8), *cache.k, *cache.v)
    k_p, p_p = pow2_at_least(k), pow2_at_least(pool)
    pad = ((0, 0), (0, k_p - k), (0, p_p - pool))
    pool_ids, pool_logits = jnp.pad(pool_ids.astype(jnp.int32), pad), jnp.pad(pool_logits.astype(jnp.float32), pad)
    weights = _layer_weights(adapter)
    inv_freq = jnp.asarray(rope_frequencies(config.block_config), jnp.float32)
    layers = config.num_layers
    seq = lambda *shape: pl.BlockSpec((None, *shape), lambda i, *_: (i,) + (0,) * len(shape))  # noqa: E731
    whole = pl.BlockSpec()
    state_specs = [seq(), seq(f_p), seq(f_p), seq(4, n_p), seq(n_p), seq(n_p, n_p)] + [whole] * (2 * layers)
    launch = dict(num_warps=num_warps, num_stages=num_stages, interpret=interpret)

    def expand(state, root_call):
        kernel = functools.partial(_expand_kernel, root_call=root_call, w=w, c_p=c_p, r_p=r_p, n=n,
                                   prefix_len=prefix_len, layers=layers, heads=config.num_heads, d=d,
                                   mlp=config.mlp_dim, eps=config.rms_norm_eps)
        extra = [tables.token, inv_freq, adapter.out_norm[...], adapter.out_norm_bias[...], *weights]
        written = [0, 1, 3, 4, 5, *range(6, len(state))]  # all but the frontier tokens
        inputs = [*state[:6], *extra, *state[6:]]
        position = lambda i: i if i < 6 else i + len(extra)  # noqa: E731
        outs = pallas_call(
            kernel, inputs, grid=(b,), in_specs=[*state_specs[:6], *[whole] * len(extra), *state_specs[6:]],
            out_specs=[state_specs[i] for i in written] + [seq(w_p, d_p), seq(w_p)],
            out_shape=[jax.ShapeDtypeStruct(state[i].shape, state[i].dtype) for i in written]
            + [jax.ShapeDtypeStruct((b, w_p, d_p), jnp.float32), jax.ShapeDtypeStruct((b, w_p), jnp.int32)],
            aliases={position(i): j for j, i in enumerate(written)}, name="weaver_expand", **launch)
        new = list(state)
        for j, i in enumerate(written):
            new[i] = outs[j]
        return tuple(new), outs[-2], outs[-1]

    def publish(state, u, nodes, root_call):
        kernel = functools.partial(_children_kernel, c=r if root_call else c, c_p=r_p if root_call else c_p, r_p=r_p,
                                   max_depth=max_depth, d=d, pool=pool)
        values, tokens = pallas_call(
            kernel, [nodes, u, state[3], state[4], pool_ids, pool_logits, tables.candidate, state[1], state[2]],
            grid=(b, w_p), in_specs=[pl.BlockSpec((None, None), lambda i, r: (i, r)),
                                     pl.BlockSpec((None, None, d_p), lambda i, r: (i, r, 0)), seq(4, n_p), seq(n_p),
                                     whole, whole, whole, seq(f_p), seq(f_p)],
            out_specs=[seq(f_p), seq(f_p)], out_shape=[jax.ShapeDtypeStruct(state[1].shape, state[1].dtype),
                                                       jax.ShapeDtypeStruct(state[2].shape, state[2].dtype)],
            aliases={7: 0, 8: 1}, name="weaver_children", **launch)
        return (state[0], values, tokens, *state[3:])

    state = publish(*expand(state, True), True)
    state = round_loop(search_calls(budget, c, w, max_depth, r), lambda _, s: publish(*expand(s, False), False), state)
    tree = state[3][:, :, :n]
    return Tree(tree[:, 0], tree[:, 1], tree[:, 2], tree[:, 3] != 0)
