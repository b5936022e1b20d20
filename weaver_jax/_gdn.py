"""Gated DeltaNet (GDN) layers' recurrence for hybrid targets (Qwen3.5 / Qwen3-Next), with
rollback-free tree verification (DESIGN 3.6).

The gated delta rule per value head, state S `[d_k, d_v]`, token t with key k (L2-normalised), query q
(L2-normalised and scaled), value v, log-decay g <= 0 and write strength beta in (0, 1):
    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  output q^T S.
Value heads share key heads: value head h reads key head h // (H_v / H_k).

Along any path from a committed state H0, with prefix_i the sum of g over node i's ancestors-or-self,
every node's u solves one unit lower-triangular system and its output is a sum over its path:
    u_i + sum_{j strict ancestor} beta_i exp(prefix_i - prefix_j) (k_i . k_j) u_j
        = beta_i (v_i - exp(prefix_i) H0^T k_i)
    o_i = exp(prefix_i) q_i^T H0 + sum_{j ancestor-or-self} exp(prefix_i - prefix_j) (q_i . k_j) u_j
so a whole tree (parents before children) is verified in one pass that writes no per-node state, and
only the accepted path is folded into H0 afterwards (`fold`). A chain is a tree: chunked prefill runs
the same form chunk by chunk (`gated_delta_chunked`). Only ratios exp(prefix_i - prefix_j) along a path
appear, never a division by a small cumulative decay.

Exact mode (`exact=True`) computes each node instead by the recurrence itself, one step from its parent's
state (the committed state at the top of the tree: `gated_delta_exact`), with every sum over d_k a
`pairwise_sum` (elementwise adds in a fixed order): a node's numbers are then those of the decode steps along
its path that would have produced it, bit for bit, and a commit repeats the accepted path's steps
(`fold_exact`). It costs a state per node and a step per node; the prefill runs the same step token by token
(`gated_delta_sequential`).

The causal depthwise conv before the rule reads, for each node, its own path's inputs and then the
committed conv state (`conv_tree`). `GatedDeltaNet` is the Qwen3.5 layer around both: `prefill`
(ragged, committed at once), a tree forward that touches no state, and `commit` of the accepted path.

Shapes: q, k `[B, T, H_k, d_k]`, v `[B, T, H_v, d_v]`, g and beta `[B, T, H_v]`, state `[B, H_v, d_k, d_v]`
float32, ancestors `[B, T, T]` bool (row i: node i's ancestors and itself).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from weaver_jax._model import causal_attend, dense, mean_square, pairwise_sum, split_grouped
from weaver_jax.pallas_kernels import interpret, kernels_enabled


class TreeTerms(NamedTuple):
    """What `fold` needs of a verified tree: the solved values and cumulative log-decays."""

    u: jax.Array  # [B, H_v, T, d_v] float32
    prefix: jax.Array  # [B, H_v, T] float32
    k: jax.Array  # [B, H_v, T, d_k] float32 (each value head's key)


def _per_value_head(q, k, v, g, beta):
    """-> float32 q, k `[B, H_v, T, d_k]`, v `[B, H_v, T, d_v]`, g, beta `[B, H_v, T]`."""
    repeat = v.shape[2] // k.shape[2]
    if repeat * k.shape[2] != v.shape[2]:
        raise ValueError(f"{v.shape[2]} value heads do not share {k.shape[2]} key heads evenly")

    def heads(x):
        return jnp.moveaxis(jnp.repeat(x.astype(jnp.float32), repeat, axis=2), 2, 1)

    return heads(q), heads(k), jnp.moveaxis(v.astype(jnp.float32), 2, 1), *(
        jnp.moveaxis(x.astype(jnp.float32), 2, 1) for x in (g, beta))


def gated_delta_tree(q, k, v, g, beta, state, ancestors) -> tuple[jax.Array, TreeTerms]:
    """Every node's output along its own root-to-node path from `state` (module docstring):
    -> (outputs `[B, T, H_v, d_v]` float32, the terms `fold` reads)."""
    q, k, v, g, beta = _per_value_head(q, k, v, g, beta)
    t = q.shape[2]
    own = ancestors.astype(jnp.float32)[:, None]  # [B, 1, T, T] ancestors-or-self
    strict = own * (1 - jnp.eye(t))
    prefix = jnp.einsum("bhij,bhj->bhi", own, g)  # [B, H, T]
    # exp(prefix_i - prefix_j) where j is on i's path (<= 1 there: g <= 0), 0 elsewhere
    ratio = jnp.where(own > 0, jnp.exp(jnp.minimum(prefix[..., :, None] - prefix[..., None, :], 0)), 0)
    decay = jnp.exp(prefix)[..., None]  # [B, H, T, 1]
    kk = jnp.einsum("bhid,bhjd->bhij", k, k, precision="highest")
    system = jnp.eye(t) + beta[..., None] * ratio * strict * kk
    rhs = beta[..., None] * (v - decay * jnp.einsum("bhid,bhde->bhie", k, state, precision="highest"))
    u = jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
    qk = jnp.einsum("bhid,bhjd->bhij", q, k, precision="highest")
    out = decay * jnp.einsum("bhid,bhde->bhie", q, state, precision="highest") + jnp.einsum(
        "bhij,bhje->bhie", ratio * qk, u, precision="highest")
    return jnp.moveaxis(out, 1, 2), TreeTerms(u, prefix, k)


def fold(state, terms: TreeTerms, path) -> jax.Array:
    """The state after the nodes of `path` `[B, T]` bool (one root-to-node path of the verified tree:
    the accepted one; none: the state unchanged), rejected branches never touched:
    S = exp(prefix_m) H0 + sum_{j on the path} exp(prefix_m - prefix_j) k_j u_j^T, m its last node."""
    on = path[:, None]  # [B, 1, T]
    # prefixes fall along a path (g <= 0): the last node's is the path's least (0 for an empty path)
    last = jnp.min(jnp.where(on, terms.prefix, 0.0), axis=-1, keepdims=True)  # [B, H, 1]
    weight = jnp.where(on, jnp.exp(jnp.minimum(last - terms.prefix, 0)), 0)  # [B, H, T]
    return jnp.exp(last)[..., None] * state + jnp.einsum("bht,bhtd,bhte->bhde", weight, terms.k, terms.u,
                                                          precision="highest")


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """Prefill: the rule over a whole sequence, `chunk` tokens at a time in the tree form (a chain),
    the state folded after each chunk. -> (outputs `[B, T, H_v, d_v]` float32, the final state).
    Padding to a whole chunk adds tokens that write nothing (beta 0) and decay nothing (g 0)."""
    b, t = q.shape[:2]
    pad = -t % chunk
    q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
    n = (t + pad) // chunk

    def split(x):  # [B, n * chunk, ...] -> [n, B, chunk, ...]
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    whole = causal_attend(b, chunk)  # a chain's ancestors-or-self

    def step(s, xs):
        out, terms = gated_delta_tree(*xs, s, whole)
        return fold(s, terms, jnp.ones((b, chunk), bool)), out

    state, out = jax.lax.scan(step, state.astype(jnp.float32), tuple(split(x) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, *out.shape[3:])[:, :t], state


def gated_delta_step(q, k, v, g, beta, state) -> tuple[jax.Array, jax.Array]:
    """One decode token (T = 1) by the recurrence itself: -> (output `[B, 1, H_v, d_v]`, new state)."""
    q, k, v, g, beta = (x[:, :, 0] for x in _per_value_head(q, k, v, g, beta))  # [B, H, ...]
    s = jnp.exp(g)[..., None, None] * state
    u = beta[..., None] * (v - jnp.einsum("bhd,bhde->bhe", k, s, precision="highest"))
    s = s + k[..., :, None] * u[..., None, :]
    return jnp.einsum("bhd,bhde->bhe", q, s, precision="highest")[:, None], s


class StepTerms(NamedTuple):
    """Exact mode's pending terms: each node's rule inputs per value head, for `fold_exact`."""

    k: jax.Array  # [B, H_v, T, d_k] float32
    v: jax.Array  # [B, H_v, T, d_v]
    g: jax.Array  # [B, H_v, T]
    beta: jax.Array  # [B, H_v, T]


def _sum_keys(x) -> jax.Array:
    """`[..., d_k, d_v] -> [..., d_v]`: the sum over d_k as a `pairwise_sum` (the same order at any shape)."""
    return pairwise_sum(jnp.swapaxes(x, -1, -2))[..., 0]


def exact_step(s, k, v, g, beta) -> jax.Array:
    """`gated_delta_step`'s update with its sum a `_sum_keys`: s `[..., d_k, d_v]`, k `[..., d_k]`, v `[..., d_v]`,
    g and beta `[...]` -> the new state. Elementwise operations only, so a token's state is the same bits in
    any batch of states."""
    s = jnp.exp(g)[..., None, None] * s
    u = beta[..., None] * (v - _sum_keys(k[..., :, None] * s))
    return s + k[..., :, None] * u[..., None, :]


def gated_delta_exact(q, k, v, g, beta, state, path) -> tuple[jax.Array, StepTerms]:
    """Exact mode's tree: every node's state by `exact_step` from its parent's (the committed `state` for a node
    at depth 0), nodes in order (parents before children), so each state is the one the decode steps along the
    node's path (`path [B, T, T]`: the node at each depth of node i's path, -1 past it,
    `weaver_jax._model.position_path`) would reach, bit for bit: one step per node, not one per node and depth
    (CPU, 27B heads: 2.6x faster at 65 nodes). -> (outputs `[B, T, H_v, d_v]` float32, the terms `fold_exact`
    reads)."""
    q, k, v, g, beta = _per_value_head(q, k, v, g, beta)  # [B, H, T, ...]
    b, _, t = g.shape
    rows = jnp.arange(b)
    by_node = [jnp.moveaxis(x, 2, 1) for x in (k, v, g, beta)]  # [B, T, H, ...]
    length = jnp.sum(path >= 0, axis=-1)  # [B, T]: a node's depth + 1 (0: no node)
    parent = jnp.take_along_axis(path, jnp.maximum(length - 2, 0)[..., None], -1)[..., 0]
    parent = jnp.where(length >= 2, parent, -1)
    start = state.astype(jnp.float32)

    def step(i, s):  # node i from its parent, an earlier node
        p = parent[:, i]
        before = jnp.where((p >= 0)[:, None, None, None], s[rows, jnp.maximum(p, 0)], start)
        stepped = exact_step(before, *(x[:, i] for x in by_node))
        return s.at[:, i].set(jnp.where((length[:, i] > 0)[:, None, None, None], stepped, before))

    s = jax.lax.fori_loop(0, t, step, jnp.zeros((b, t, *start.shape[1:]), jnp.float32))
    return _sum_keys(jnp.moveaxis(q, 2, 1)[..., :, None] * s), StepTerms(k, v, g, beta)


def fold_exact(state, terms: StepTerms, path_nodes, length) -> jax.Array:
    """Exact mode's commit: the accepted path's first `length [B]` nodes of `path_nodes [B, P]` (root first)
    stepped into `state` one by one - the operations the tree ran for its last node, and a decode step for each."""
    rows = jnp.arange(state.shape[0])

    def along(j, s):
        node = path_nodes[:, j]
        stepped = exact_step(s, *(x[rows, :, node] for x in terms))
        return jnp.where((j < length)[:, None, None, None], stepped, s)

    return jax.lax.fori_loop(0, jnp.max(length), along, state)


def gated_delta_sequential(q, k, v, g, beta, state) -> tuple[jax.Array, jax.Array]:
    """Exact mode's prefill: `exact_step` token by token (beta and g zero: a token that writes nothing). ->
    (outputs `[B, T, H_v, d_v]` float32, the final state)."""
    q, k, v, g, beta = (jnp.moveaxis(x, 2, 0) for x in _per_value_head(q, k, v, g, beta))  # [T, B, H, ...]

    def step(s, xs):
        q_t, *rest = xs
        s = exact_step(s, *rest)
        return s, _sum_keys(q_t[..., :, None] * s)

    state, out = jax.lax.scan(step, state.astype(jnp.float32), (q, k, v, g, beta))
    return jnp.moveaxis(out, 0, 1), state


def conv_tree(x, conv_state, weight, path, depth, bias=None) -> jax.Array:
    """The causal depthwise conv of width W (then SiLU) for every node: x `[B, T, C]` the nodes'
    inputs, conv_state `[B, C, W - 1]` the committed inputs (oldest first), weight `[C, W]` (tap W - 1
    multiplies the token itself), path `[B, T, T]` int32 (path[b, i, j]: the node at depth j on node
    i's path, `weaver_jax._model.position_path`), depth `[B, T]`. Node i's window is its path's last
    inputs, then the committed state's. -> `[B, T, C]` float32."""
    width = weight.shape[1]
    b, t, c = x.shape
    x32, state32 = x.astype(jnp.float32), conv_state.astype(jnp.float32)
    total = jnp.zeros((b, t, c), jnp.float32) if bias is None else jnp.broadcast_to(bias.astype(jnp.float32),
                                                                                    (b, t, c))
    for back in range(width):  # tap width - 1 - back reads the input `back` steps back along the path
        at = depth - back  # [B, T]: the depth read; < 0 reads the committed state
        node = jnp.take_along_axis(path, jnp.clip(at, 0, t - 1)[..., None], axis=2)[..., 0]
        from_tree = jnp.take_along_axis(x32, jnp.clip(node, 0, t - 1)[..., None], axis=1)
        slot = jnp.clip(width - 1 + at, 0, width - 2)  # conv_state column for at < 0
        from_state = jnp.take_along_axis(jnp.moveaxis(state32, 1, 2), slot[..., None], axis=1)
        total = total + jnp.where((at >= 0)[..., None], from_tree, from_state) * weight[:, width - 1 - back].astype(
            jnp.float32)
    return jax.nn.silu(total)


def fold_conv(conv_state, x, path_nodes, length) -> jax.Array:
    """The conv state after the accepted path: its inputs x `[B, T, C]` at `path_nodes [B, P]` (root
    first), the first `length [B]` of them, appended to `conv_state [B, C, W - 1]`, the last W - 1 kept."""
    keep = conv_state.shape[2]
    p = path_nodes.shape[1]
    taken = jnp.moveaxis(jnp.take_along_axis(x, path_nodes[..., None], axis=1), 1, 2).astype(conv_state.dtype)
    joined = jnp.concatenate([conv_state, taken], axis=2)  # [B, C, W - 1 + P]
    # the last W - 1 of the first W - 1 + length columns: they start at column `length`
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, keep, axis=1))(joined, jnp.minimum(length, p))


class GDNState(NamedTuple):
    """A GDN layer's committed state: the rule's `[B, H_v, d_k, d_v]` (float32) and the conv's last
    inputs `[B, C, W - 1]` (oldest first), C = 2 H_k d_k + H_v d_v."""

    recurrent: jax.Array
    conv: jax.Array


class GDNPending(NamedTuple):
    """What a tree forward leaves for `GatedDeltaNet.commit`: the tree terms and the conv inputs."""

    terms: TreeTerms | StepTerms
    conv_inputs: jax.Array  # [B, T, C]


def l2_normalize(x, eps: float = 1e-6, exact: bool = False):
    x = x.astype(jnp.float32)
    squares = pairwise_sum(x * x) if exact else jnp.sum(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(squares + eps)


class GatedDeltaNet(nnx.Module):
    """The Qwen3.5 linear-attention layer (Gated DeltaNet): projections to the mixed q / k / v, the
    gate z and the write / decay inputs b, a; the causal depthwise conv (then SiLU) over the mixed
    channels; L2-normalised q (scaled by d_k^-1/2) and k; beta = sigmoid(b), g = -exp(A_log) *
    softplus(a + dt_bias); the gated delta rule; the gated RMSNorm rms(o) * weight * silu(z) per value
    head; the output projection. Weights `[in, out]`; conv `[C, W]`."""

    groups: int = 1  # as `_model.Attention`'s: `in_qkv`'s columns and `conv`'s rows grouped per device

    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_width: int, eps: float, dtype, *, rngs: nnx.Rngs):
        from weaver_jax._model import _param

        self.heads = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.eps = eps
        key, value = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.in_qkv = _param(rngs, (hidden, 2 * key + value), dtype, hidden)
        self.in_z = _param(rngs, (hidden, value), dtype, hidden)
        self.in_b = _param(rngs, (hidden, num_v_heads), dtype, hidden)
        self.in_a = _param(rngs, (hidden, num_v_heads), dtype, hidden)
        self.conv = _param(rngs, (2 * key + value, conv_width), dtype, conv_width)
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, num_v_heads)).astype(jnp.float32))
        self.dt_bias = nnx.Param(jnp.ones((num_v_heads,), jnp.float32))
        self.norm = nnx.Param(jnp.ones((head_v_dim,), dtype))
        self.out = _param(rngs, (value, hidden), dtype, value)

    def init_state(self, batch: int) -> GDNState:
        h_k, h_v, d_k, d_v = self.heads
        return GDNState(jnp.zeros((batch, h_v, d_k, d_v), jnp.float32),
                        jnp.zeros((batch, self.conv.shape[0], self.conv.shape[1] - 1), self.conv.dtype))

    def fused(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """The fused parameters: their q | k | v segments and the axis they are concatenated on."""
        h_k, h_v, d_k, d_v = self.heads
        segments = (h_k * d_k, h_k * d_k, h_v * d_v)
        return {"in_qkv": (segments, -1), "conv": (segments, 0)}

    def _inputs(self, x, mixed_conv, exact: bool = False):
        """-> q, k `[B, T, H_k, d_k]` (normalised, q scaled), v `[B, T, H_v, d_v]`, g, beta `[B, T, H_v]`."""
        h_k, h_v, d_k, d_v = self.heads
        b, t, _ = x.shape
        q, k, v = split_grouped(mixed_conv, self.fused()["in_qkv"][0], self.groups)
        q = l2_normalize(q.reshape(b, t, h_k, d_k), exact=exact) * d_k ** -0.5
        k = l2_normalize(k.reshape(b, t, h_k, d_k), exact=exact)
        v = v.reshape(b, t, h_v, d_v)
        beta = jax.nn.sigmoid(dense(x, self.in_b[...], exact, split="columns").astype(jnp.float32))
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(dense(x, self.in_a[...], exact, split="columns").astype(
            jnp.float32) + self.dt_bias[...])
        return q, k, v, g, beta

    def _output(self, x, o, exact: bool = False):
        """The gated RMSNorm per value head and the output projection: o `[B, T, H_v, d_v]` -> `[B, T, D]`."""
        b, t, h_v, d_v = o.shape
        z = dense(x, self.in_z[...], exact, split="columns").astype(jnp.float32).reshape(b, t, h_v, d_v)
        o = o * jax.lax.rsqrt(mean_square(o, exact) + self.eps) * self.norm[...].astype(jnp.float32) * jax.nn.silu(z)
        return dense(o.reshape(b, t, h_v * d_v).astype(x.dtype), self.out[...], exact, split="rows")

    def prefill(self, x, state: GDNState, lengths, chunk: int = 64, exact: bool = False) -> tuple[jax.Array, GDNState]:
        """A right-padded sequence `[B, T, D]` after the committed state, its first `lengths [B]` tokens
        committed (padding writes nothing: beta and g are zeroed there): -> (`[B, T, D]`, the new state)."""
        b, t, _ = x.shape
        width = self.conv.shape[1]
        mixed = dense(x, self.in_qkv[...], exact, split="columns")
        seq = jnp.concatenate([jnp.moveaxis(state.conv, 1, 2).astype(mixed.dtype), mixed], axis=1)  # [B, W-1+T, C]
        z = jnp.zeros((b, t, seq.shape[2]), jnp.float32)
        for tap in reversed(range(width)):  # the token itself first, as `conv_tree` adds them (exact mode)
            z = z + seq[:, tap:tap + t].astype(jnp.float32) * self.conv[:, tap].astype(jnp.float32)
        q, k, v, g, beta = self._inputs(x, jax.nn.silu(z), exact)
        real = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]
        g, beta = jnp.where(real, g, 0), jnp.where(real, beta, 0)
        if exact:
            o, recurrent = gated_delta_sequential(q, k, v, g, beta, state.recurrent)
        else:
            o, recurrent = gated_delta_chunked(q, k, v, g, beta, state.recurrent, chunk)
        conv = fold_conv(state.conv, mixed, jnp.broadcast_to(jnp.arange(t), (b, t)), lengths)
        return self._output(x, o, exact), GDNState(recurrent, conv)

    def __call__(self, x, state: GDNState, depth, ancestors, exact: bool = False) -> tuple[jax.Array, GDNPending]:
        """Tree verification (a decode step is a tree of one node): x `[B, T, D]`, depth `[B, T]` past
        the committed state, ancestors `[B, T, T]` bool (ancestors-or-self). Every node's output along its
        own path; the state is not touched. -> (`[B, T, D]`, what `commit` folds). exact: each node by the
        recurrence along its path (`gated_delta_exact`), bitwise its decode steps'."""
        from weaver_jax._model import position_path

        b = x.shape[0]
        mixed = dense(x, self.in_qkv[...], exact, split="columns")
        path = position_path(depth, jnp.zeros((b,), jnp.int32), ancestors)
        q, k, v, g, beta = self._inputs(x, conv_tree(mixed, state.conv, self.conv[...], path, depth), exact)
        if exact:
            o, terms = gated_delta_exact(q, k, v, g, beta, state.recurrent, path)
            return self._output(x, o, exact), GDNPending(terms, mixed)
        # the kernel's tiles need head dims 2^k >= 16
        if kernels_enabled("tree_gdn") and all(d >= 16 and d & (d - 1) == 0 for d in self.heads[2:]):
            from weaver_jax.pallas_kernels._call import batch_heads, per_shard
            from weaver_jax.pallas_kernels.tree_gdn import tree_gdn

            h_k = self.heads[0]  # per device: its key heads and the value heads that share them
            on = lambda ndim, axis: batch_heads(ndim, h_k, axis)  # noqa: E731
            o, u, prefix = per_shard(lambda *a: tree_gdn(*a, interpret=interpret()),
                                     (q, k, v, g, beta, state.recurrent, ancestors),
                                     (on(4, 2), on(4, 2), on(4, 2), on(3, 2), on(3, 2), on(4, 1), batch_heads(3)),
                                     (on(4, 2), on(4, 1), on(3, 1)))
            terms = TreeTerms(u, prefix, _per_value_head(q, k, v, g, beta)[1])
        else:
            o, terms = gated_delta_tree(q, k, v, g, beta, state.recurrent, ancestors)
        return self._output(x, o), GDNPending(terms, mixed)

    def commit(self, state: GDNState, pending: GDNPending, path_nodes, length) -> GDNState:
        """Fold the accepted path, node indices `path_nodes [B, P]` root first, its first `length [B]`
        (0: nothing), into the state; rejected branches never touch it."""
        t = pending.conv_inputs.shape[1]
        on = jnp.any((path_nodes[:, :, None] == jnp.arange(t)) & (jnp.arange(path_nodes.shape[1])[None, :, None]
                                                                  < length[:, None, None]), axis=1)  # [B, T]
        if isinstance(pending.terms, StepTerms):  # exact mode
            recurrent = fold_exact(state.recurrent, pending.terms, path_nodes, length)
        else:
            recurrent = fold(state.recurrent, pending.terms, on)
        return GDNState(recurrent, fold_conv(state.conv, pending.conv_inputs, path_nodes, length))
