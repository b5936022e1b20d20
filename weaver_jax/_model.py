"""The target transformer (Flax NNX) and its static-shape KV cache.

One forward serves prefill, one-token decode and tree verification. The new tokens' K/V are
written to the cache slots `[lengths, lengths + T)` of each sequence; every new token sees the
committed prefix `[0, lengths)` plus the new tokens that `attend` allows. The forward never
advances `lengths`: the caller decides what becomes committed (decode: all of it; a tree: the
accepted path), so slots past `lengths` are scratch space and nothing is ever rolled back.

Weights are kept per layer in a Python list with fused qkv and gate/up projections: a decode
step then streams each weight once without the per-layer dynamic-slice copy of `lax.scan`
over stacked weights (DESIGN section 4).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from weaver_jax._config import ModelConfig
from weaver_jax.pallas_kernels import interpret, kernels_enabled
from weaver_jax.pallas_kernels._call import context_mesh

_NEG_INF = float(jnp.finfo(jnp.float32).min)
# The most new tokens a sequence's forward may have for its attention to norm, rotate and write the cache inside
# the tree-attention kernel (`attention_from_qkv`): decode steps, the chain's 16-node verification and the
# drafter's block (`Attention._attend_from_qkv` says why)
FROM_QKV_MAX_NODES = 16


def fresh_cache(model, batch: int, size: int):
    """`model.init_cache(batch, size)` (any model with a frozen `config`) made by one compiled program, for host
    code: made op by op a cache is a dispatch per layer and tensor (~10 ms for a 30-layer target, paid by every
    `generate` and stream). Traced code calls `init_cache` itself."""
    key = (type(model), model.config, batch, size)
    if key not in _CACHE_SHAPES:
        _CACHE_SHAPES[key] = jax.eval_shape(lambda: model.init_cache(batch, size))
    leaves, treedef = jax.tree.flatten(_CACHE_SHAPES[key])
    return treedef.unflatten(_zeros_program(tuple((x.shape, x.dtype) for x in leaves))())


_CACHE_SHAPES: dict = {}  # init_cache's abstract result per (model class, config, batch, size): no weights


@functools.cache
def _zeros_program(specs):
    return jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype in specs))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer K/V `[B, S, H_kv, D]` and committed lengths `[B]` (int32): slots `[0, lengths)` hold the
    committed tokens; a forward writes its new tokens' K/V past them and leaves `lengths` to the caller's commit.

        cache = bundle.target.init_cache(batch=2, size=512)     # (a hybrid target's: a HybridCache)
        cache.lengths, cache.size
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def init(cls, config: ModelConfig, batch: int, size: int, dtype=None) -> KVCache:
        dtype = dtype or config.jnp_dtype
        shape = (batch, size, config.num_kv_heads, config.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def size(self) -> int:
        return self.k[0].shape[1]

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


class ForwardOutput(NamedTuple):
    """What a target's forward (or `prefill`) returns: logits `[B, R, V]` float32, the requested layers' hidden
    states (one `[B, T, D]` each), the cache with the new K/V written past `lengths` (left to the caller's commit):

        out = bundle.target.prefill(tokens, bundle.target.init_cache(1, 256), jnp.asarray([len(ids)]))
        out.logits[0, -1].argmax(), out.cache.k[0].shape                  # [1, 256, H_kv, D]
    """

    logits: jax.Array  # [B, R, V] float32 for the requested rows (R = T when rows is None)
    hidden: tuple[jax.Array, ...]  # one [B, T, D] per requested layer (output of that layer)
    cache: KVCache  # new K/V written at [lengths, lengths + T); lengths unchanged
    # what the target's `commit` folds besides K/V: a hybrid target's GDN terms (`_hybrid`); none for attention
    pending: tuple = ()


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies `[D/2]` (float64), with Llama-3 scaling when configured."""
    d = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x `[B, T, H, D]`, positions `[B, T]`; rotation by split halves (the HF convention)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, bias: jax.Array | None = None,
             exact: bool = False) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(mean_square(x32, exact) + eps) * scale.astype(jnp.float32)
    return (y if bias is None else y + bias.astype(jnp.float32)).astype(x.dtype)


def mean_square(x: jax.Array, exact: bool = False) -> jax.Array:
    """`[..., D] -> [..., 1]`: the mean of x * x over the last axis, what a norm divides by (exact: by
    `pairwise_sum`, the same order at any shape)."""
    return pairwise_sum(x * x) / x.shape[-1] if exact else jnp.mean(x * x, axis=-1, keepdims=True)


def pairwise_sum(x: jax.Array) -> jax.Array:
    """`[..., D] -> [..., 1]`: the sum over the last axis by halving (zero-padded to a power of two),
    all elementwise adds, so the order cannot depend on the other axes (exact mode: XLA picks a
    reduction's order from the whole shape)."""
    width = 1 << (x.shape[-1] - 1).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    while x.shape[-1] > 1:
        x = x[..., : x.shape[-1] // 2] + x[..., x.shape[-1] // 2 :]
    return x


def dense(x: jax.Array, w: jax.Array, exact: bool = False, transpose_w: bool = False,
          split: str | None = None) -> jax.Array:
    """`x @ w` (`w.T` with transpose_w) in x's dtype; exact: each row's product is independent of
    the other rows (`row_invariant_product`)."""
    if exact:
        return row_invariant_product(x, w, split, transpose_w).astype(x.dtype)
    return x @ (w.T if transpose_w else w)


def row_invariant_product(x: jax.Array, w: jax.Array, split: str | None = None,
                          transpose_w: bool = False) -> jax.Array:
    """`x @ w` in float32 by the row-invariant kernel (exact mode's products and LM heads), run per device where a
    sharded bundle splits w over its `model` axis by `split` ("columns" or "rows":
    `pallas_kernels._call.per_shard_product`)."""
    from weaver_jax.pallas_kernels._call import per_shard_product
    from weaver_jax.pallas_kernels.row_invariant import matmul

    product = functools.partial(matmul, transpose_w=transpose_w, interpret=interpret())
    return per_shard_product(product, x, w, split, transpose_w)


def visibility_mask(lengths: jax.Array, attend: jax.Array, cache_size: int) -> jax.Array:
    """`[B, T, S]` bool: slot s is visible to new token t if it is committed (s < len) or holds
    a new token that `attend [B, T, T]` allows."""
    t = attend.shape[1]
    rel = jnp.arange(cache_size)[None, :] - lengths[:, None]  # [B, S]
    is_new = (rel >= 0) & (rel < t)
    new_visible = jnp.take_along_axis(
        attend, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], attend.shape[:2] + (cache_size,)),
        axis=2)
    return (rel < 0)[:, None, :] | (is_new[:, None, :] & new_visible)


def causal_attend(batch: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def _write(cache_layer: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """Write new `[B, T, H, D]` at slots `[lengths, lengths + T)` of each sequence; slots past the
    cache are dropped (never shifted). One scatter of T rows per sequence, the batch a batching dimension of
    the scatter (so a batch split over devices stays split): a vmapped dynamic_update_slice became a dynamic
    slice, a select and an update per write on a GPU (BENCHMARKS.md)."""
    slots = lengths[:, None] + jnp.arange(new.shape[1])
    return jax.vmap(lambda c, n, s: c.at[s].set(n, mode="drop", indices_are_sorted=True, unique_indices=True))(
        cache_layer, new, slots)


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """GQA attention: q `[B, T, K, G, D]` over k, v `[B, S, K, D]` where mask `[B, T, S]`."""
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores / math.sqrt(q.shape[-1]), _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)


def group_columns(w: jax.Array, segments: tuple[int, ...], groups: int, axis: int = -1) -> jax.Array:
    """A fused projection's `axis` (the last: its columns), the concatenation of `segments` (q | k | v,
    gate | up), reordered so that each of `groups` equal blocks holds its share of every segment:
    [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]. Sharded over `groups` devices, a block is one device's heads / features
    whole (`weaver_jax.shard`)."""
    parts = jnp.split(w, np.cumsum(segments)[:-1], axis=axis)
    return jnp.concatenate([jnp.split(p, groups, axis=axis)[g] for g in range(groups) for p in parts], axis=axis)


def split_grouped(y: jax.Array, segments: tuple[int, ...], groups: int) -> list[jax.Array]:
    """The segments of `y [..., sum(segments)]` whose last axis is in `group_columns` order, each in its original
    order (`groups` 1: a plain split). Local to a device when that axis is sharded over `groups`."""
    y = y.reshape(*y.shape[:-1], groups, -1)
    bounds = np.cumsum([0, *(s // groups for s in segments)])
    return [y[..., a:b].reshape(*y.shape[:-2], -1) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def ungroup_columns(w: jax.Array, segments: tuple[int, ...], groups: int, axis: int = -1) -> jax.Array:
    """`group_columns` undone: the segments back in their original order."""
    w = jnp.moveaxis(w, axis, -1)
    return jnp.moveaxis(jnp.concatenate(split_grouped(w, segments, groups), axis=-1), -1, axis)


def _param(rngs: nnx.Rngs, shape, dtype, fan_in: int) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype))


class Attention(nnx.Module):
    # How many blocks `qkv`'s columns are grouped in (`group_columns`): 1, or the `model` axis of a mesh the
    # module is sharded over (`weaver_jax.shard`), so that each device holds its heads' q, k and v whole.
    groups: int = 1

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        qkv_width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv = _param(rngs, (c.hidden_size, qkv_width), dt, c.hidden_size)
        self.qkv_bias = _param(rngs, (qkv_width,), dt, 1) if c.qkv_bias else None
        self.q_norm = nnx.Param(jnp.ones((c.head_dim,), dt)) if c.qk_norm else None
        self.k_norm = nnx.Param(jnp.ones((c.head_dim,), dt)) if c.qk_norm else None
        self.out = _param(rngs, (c.num_heads * c.head_dim, c.hidden_size), dt, c.num_heads * c.head_dim)

    def split(self, how: str) -> str | None:
        """How a weight of this module is split over the devices (`dense`'s split): `how` when sharded, else None."""
        return how if self.groups > 1 else None

    def fused(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """The fused parameters: their segments and the axis they are concatenated on (what `group_columns`
        reorders)."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        return {name: ((h * d, kv * d, kv * d), -1) for name in ("qkv", "qkv_bias") if getattr(self, name) is not None}

    def fused_qkv(self, x, exact: bool = False):
        """x `[B, T, D]` -> the fused projection's output `[B, T, (H + 2 H_kv) hd]`, bias added."""
        qkv = dense(x, self.qkv[...], exact, split=self.split("columns"))
        return qkv if self.qkv_bias is None else qkv + self.qkv_bias[...]

    def project(self, x, positions, inv_freq, exact: bool = False):
        """x `[B, T, D]` -> q `[B, T, H, hd]`, k, v `[B, T, H_kv, hd]` (normed and rotated)."""
        b, t, _ = x.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = split_grouped(self.fused_qkv(x, exact), self.fused()["qkv"][0], self.groups)
        q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, kv, d), v.reshape(b, t, kv, d)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm[...], self.eps, exact=exact), rms_norm(k, self.k_norm[...], self.eps,
                                                                                   exact=exact)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def __call__(self, x, positions, inv_freq, k_cache, v_cache, lengths, mask):
        b, t, _ = x.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if (t <= FROM_QKV_MAX_NODES and isinstance(mask, TreeVisibility) and kernels_enabled("attention_from_qkv")
                and self._heads_whole_per_device()):
            return self._attend_from_qkv(x, positions, inv_freq, k_cache, v_cache, lengths, mask)
        exact = isinstance(mask, PositionPath)
        q, k, v = self.project(x, positions, inv_freq, exact)
        k_cache, v_cache = _write(k_cache, k, lengths), _write(v_cache, v, lengths)
        if exact:  # the row-invariant kernel, by position
            from weaver_jax.pallas_kernels.row_invariant import attention

            o = per_head_kernel(lambda *a: attention(*a, interpret=interpret()), kv,
                                (q, k_cache, v_cache), (positions, lengths, mask.path))
        elif isinstance(mask, TreeVisibility):  # the Pallas kernel: prefix [0, len) + `attend` among the new tokens
            from weaver_jax.pallas_kernels.tree_attention import tree_attention

            o = per_head_kernel(lambda *a: tree_attention(*a, interpret=interpret()), kv, (q, k_cache, v_cache),
                                (lengths, mask.attend))
        elif isinstance(mask, SlotVisibility):  # the Pallas kernel gathering each query's slots
            from weaver_jax.pallas_kernels.adapter_attention import adapter_attention

            o = per_head_kernel(lambda *a: adapter_attention(*a, interpret=interpret()), kv, (q, k_cache, v_cache),
                                (mask.slots,))
        else:
            o = gqa_attention(q.reshape(b, t, kv, h // kv, d), k_cache, v_cache, mask)
        return (dense(o.astype(x.dtype).reshape(b, t, h * d), self.out[...], exact, split=self.split("rows")), k_cache,
                v_cache)

    def _heads_whole_per_device(self) -> bool:
        """Whether each device holds its heads' q, k and v columns together (one device, or grouped for the
        context mesh's `model` axis by `weaver_jax.shard`): what the from-qkv kernel reads per device."""
        mesh = context_mesh()
        return mesh is None or self.groups == mesh.shape["model"]

    def _attend_from_qkv(self, x, positions, inv_freq, k_cache, v_cache, lengths, mask):
        """`__call__` with the q / k norms, the rotation and the cache writes inside the tree-attention kernel
        (`tree_attention_from_qkv`: six launches a layer fewer at the Qwen3 shapes). Up to 16 new tokens a
        sequence: measured on an H100, a step 11% faster at SmolLM2's shape and 2.5% at Qwen3-8B's, a 16-node
        verification 5% / 0.4% faster, but 32 nodes +5% at 8B and 64 nodes +9% / +17% (every program norms and
        rotates its query rows, once per prefix split, and each tree program all the new keys, before its first
        product; with the queries normed and rotated once in XLA instead, 32 and 64 nodes lost as well). Under a
        sharded bundle's mesh the kernel runs per device on its sequences and heads (`per_shard`): its block of
        qkv's grouped columns, its caches' heads."""
        from weaver_jax.pallas_kernels._call import batch_heads, per_shard
        from weaver_jax.pallas_kernels.tree_attention import rope_table, tree_attention_from_qkv

        b, t, _ = x.shape
        qkv = self.fused_qkv(x)
        norms = (self.q_norm[...], self.k_norm[...]) if self.q_norm is not None else (None, None)
        heads = self.num_heads // self.groups  # a device's

        def attend(qkv, rope, k_cache, v_cache, lengths, ancestors):
            return tree_attention_from_qkv(qkv, rope, *norms, k_cache, v_cache, lengths, ancestors, heads=heads,
                                           eps=self.eps if self.q_norm is not None else None, interpret=interpret())

        split = batch_heads(4, self.num_kv_heads)  # the caches, the output: batch and heads
        o, k_cache, v_cache = per_shard(
            attend, (qkv, rope_table(positions, inv_freq), k_cache, v_cache, lengths, mask.attend),
            (batch_heads(3, self.num_kv_heads), batch_heads(4), split, split, batch_heads(1), batch_heads(3)),
            (split, split, split))
        return dense(o.reshape(b, t, -1), self.out[...], split=self.split("rows")), k_cache, v_cache


def per_head_kernel(kernel, kv_heads: int, heads: tuple, rows: tuple) -> jax.Array:
    """`kernel(*heads, *rows)` for an attention kernel whose `heads` arrays (q `[B, T, H, D]`, the caches
    `[B, S, H_kv, D]`) and output are split by batch and heads and whose `rows` (`[B, ...]`) by batch: per
    device under a sharded bundle's mesh (`pallas_kernels._call.per_shard`), else as it is."""
    from weaver_jax.pallas_kernels._call import batch_heads, per_shard

    spec = batch_heads(4, kv_heads)
    return per_shard(kernel, (*heads, *rows), (spec,) * len(heads) + tuple(batch_heads(r.ndim) for r in rows), spec)


def _bias(shape, dtype, present: bool) -> nnx.Param | None:
    return nnx.Param(jnp.zeros(shape, dtype)) if present else None


def _value(param: nnx.Param | None):
    return None if param is None else param[...]


class MLP(nnx.Module):
    groups: int = 1  # as Attention's, for `gate_up`

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, bias: bool = False):
        c, dt = config, config.jnp_dtype
        self.gate_up = _param(rngs, (c.hidden_size, 2 * c.intermediate_size), dt, c.hidden_size)
        self.gate_up_bias = _bias((2 * c.intermediate_size,), dt, bias)
        self.down = _param(rngs, (c.intermediate_size, c.hidden_size), dt, c.intermediate_size)
        self.down_bias = _bias((c.hidden_size,), dt, bias)

    split = Attention.split

    def fused(self) -> dict[str, tuple[tuple[int, ...], int]]:
        f = self.down.shape[0]
        return {name: ((f, f), -1) for name in ("gate_up", "gate_up_bias") if getattr(self, name) is not None}

    def __call__(self, x, exact: bool = False):
        h = dense(x, self.gate_up[...], exact, split=self.split("columns"))
        h = h if self.gate_up_bias is None else h + self.gate_up_bias[...]
        gate, up = split_grouped(h, self.fused()["gate_up"][0], self.groups)
        y = dense(jax.nn.silu(gate) * up, self.down[...], exact, split=self.split("rows"))
        return y if self.down_bias is None else y + self.down_bias[...]


class Block(nnx.Module):
    """Pre-norm block. The targets use neither flag; the Weaver adapter's published layout has
    biases on its RMSNorms and its MLP."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, norm_bias: bool = False, mlp_bias: bool = False):
        dt = config.jnp_dtype
        self.eps = config.rms_norm_eps
        self.attn_norm = nnx.Param(jnp.ones((config.hidden_size,), dt))
        self.attn_norm_bias = _bias((config.hidden_size,), dt, norm_bias)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = nnx.Param(jnp.ones((config.hidden_size,), dt))
        self.mlp_norm_bias = _bias((config.hidden_size,), dt, norm_bias)
        self.mlp = MLP(config, rngs=rngs, bias=mlp_bias)

    def __call__(self, x, positions, inv_freq, k_cache, v_cache, lengths, mask):
        exact = isinstance(mask, PositionPath)
        a, k_cache, v_cache = self.attn(rms_norm(x, self.attn_norm[...], self.eps, _value(self.attn_norm_bias), exact),
                                        positions, inv_freq, k_cache, v_cache, lengths, mask)
        x = x + a
        return (x + self.mlp(rms_norm(x, self.mlp_norm[...], self.eps, _value(self.mlp_norm_bias), exact), exact),
                k_cache, v_cache)


class Transformer(nnx.Module):
    """Decoder-only LM: embedding, `num_layers` pre-norm blocks, final RMSNorm, LM head.

    Weight layout is `[in, out]`; `embed` is `[V, D]`; `lm_head` is `[D, V]` or absent when tied. One forward
    serves prefill, decode steps and tree verification (`__call__`); `prefill` and `commit` advance the cache.

        target = weaver_jax.load("smollm2-135m-instruct").target
        out = target.prefill(jnp.asarray([[1, 2, 3]]), target.init_cache(1, 64), jnp.asarray([3]))
        out.logits.shape, out.cache.lengths                            # [1, 3, V], [3]
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dt = config.jnp_dtype
        self.embed = _param(rngs, (config.vocab_size, config.hidden_size), dt, config.hidden_size)
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((config.hidden_size,), dt))
        self.lm_head = None if config.tie_embeddings else _param(
            rngs, (config.hidden_size, config.vocab_size), dt, config.hidden_size)

    def init_cache(self, batch: int, size: int) -> KVCache:
        return KVCache.init(self.config, batch, size)

    def prefill(self, tokens, cache: KVCache, lengths, **options) -> ForwardOutput:
        """Right-padded tokens `[B, T]` after the committed ones, the first `lengths [B]` real: the forward
        (`__call__`'s keyword options) with those tokens committed (lengths advanced)."""
        positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
        out = self(tokens, positions, cache, **options)
        return out._replace(cache=out.cache.with_lengths(cache.lengths + lengths))

    def commit(self, cache: KVCache, pending: tuple, path: jax.Array, count: jax.Array) -> KVCache:
        """After a forward whose accepted nodes' K/V are in place at `[len, len + count)` (a decode step's
        token, or a tree's path moved by `accept_and_move`): commit the first `count [B]` of `path [B, P]`.
        An attention-only target holds nothing else: the lengths advance (see the hybrid target's)."""
        del pending, path
        return cache.with_lengths(cache.lengths + count)

    def logits(self, h: jax.Array) -> jax.Array:
        """Final norm + LM head: `[..., D] -> [..., V]` float32."""
        return self.head(self.final_state(h))

    def final_state(self, h: jax.Array, exact: bool = False) -> jax.Array:
        """The final RMSNorm of last-layer outputs `[..., D]` (what the LM head reads)."""
        return rms_norm(h, self.final_norm[...], self.config.rms_norm_eps, exact=exact)

    def head(self, h: jax.Array, exact: bool = False) -> jax.Array:
        """The LM head alone (the drafter applies it to its own normed states): `[..., D] -> [..., V]`."""
        if exact:  # the untied head is split by vocabulary on a sharded target (the tied embedding is whole)
            tied = self.lm_head is None
            split = None if tied else self.layers[0].attn.split("columns")
            return row_invariant_product(h, self.embed[...] if tied else self.lm_head[...], split, tied)
        if self.lm_head is None:
            return jnp.einsum("...d,vd->...v", h, self.embed[...], preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", h, self.lm_head[...], preferred_element_type=jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        attend: jax.Array | None = None,
        *,
        logits_rows: jax.Array | None = None,
        hidden_layers: tuple[int, ...] = (),
        exact: bool = False,
    ) -> ForwardOutput:
        """tokens, positions `[B, T]` int (each new token at `cache.lengths +` its depth among them);
        attend `[B, T, T]` bool (None: causal); logits_rows `[B, R]` row indices into T (None: every
        row). exact: a token's numbers do not depend on the other tokens of the call (row-invariant
        products and attention by position: `weaver_jax.pallas_kernels.row_invariant`), so a decode
        step, a prefill and a tree verification give it bitwise the same logits."""
        b, t = tokens.shape
        if t > cache.size:
            raise ValueError(f"{t} new tokens do not fit in a cache of {cache.size} slots")
        if any(not 0 <= i < self.config.num_layers for i in hidden_layers):
            raise ValueError(f"hidden_layers {hidden_layers} outside [0, {self.config.num_layers})")
        if attend is None:
            attend = causal_attend(b, t)
        x = jnp.take(self.embed[...], tokens, axis=0)
        d = self.config.head_dim
        # The kernel's tiles need d = 2^k >= 16. It serves decode steps too: at one token it measured
        # 1.08-1.20x XLA's attention at the Qwen3-8B shape and 1.23-1.79x at SmolLM2's (BENCHMARKS.md)
        kernel = kernels_enabled("tree_attention") and d >= 16 and d & (d - 1) == 0
        mask = PositionPath(position_path(positions, cache.lengths, attend)) if exact else None
        x, hidden, new_cache = run_blocks(self.layers, x, positions, rope_frequencies(self.config), cache, attend,
                                          hidden_layers, mask, kernel=kernel)
        if exact:  # rows picked after the norm: a gather between the last residual add and the norm would
            # change what XLA may fuse (and round) there, and with it the row's numbers
            x = self.final_state(x, exact=True)
            if logits_rows is not None:
                x = jnp.take_along_axis(x, logits_rows[..., None], axis=1)
            return ForwardOutput(self.head(x, exact=True), hidden, new_cache)
        if logits_rows is not None:
            x = jnp.take_along_axis(x, logits_rows[..., None], axis=1)
        return ForwardOutput(self.logits(x), hidden, new_cache)


class TreeVisibility(NamedTuple):
    """Visibility given as the committed prefix plus `attend [B, T, T]` (int8, 1: visible) among the
    new tokens, for the tree-attention kernel (which never builds the `[B, T, S]` mask; the table is
    converted from bool once per forward, not once per layer)."""

    attend: jax.Array


class PositionPath(NamedTuple):
    """Exact mode's visibility: the committed prefix, then `path [B, T, T]` (`position_path`): which new
    token each new token sees at each position past the prefix. Every product and reduction of a layer
    given this one is row-invariant."""

    path: jax.Array


def position_path(positions: jax.Array, lengths: jax.Array, attend: jax.Array) -> jax.Array:
    """positions `[B, T]` (each new token at `lengths +` its depth), attend `[B, T, T]` bool -> `[B, T, T]`
    int32: path[b, t, j] = the new token at position `lengths[b] + j` that token t sees (-1: none)."""
    b, t = positions.shape
    column = jnp.where(attend, (positions - lengths[:, None])[:, None, :], t)  # out of range where unseen
    return jnp.full((b, t, t), -1, jnp.int32).at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None],
                                                 column].max(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32),
                                                                              (b, t, t)), mode="drop")


class SlotVisibility(NamedTuple):
    """Visibility as the cache slots each new token sees, `slots [B, T, L]` (-1: none), for the
    adapter-attention kernel (which gathers those rows instead of masking all S)."""

    slots: jax.Array


def run_blocks(layers, x, positions, inv_freq, cache: KVCache, attend, hidden_layers=(), mask=None,
               kernel: bool = False):
    """The layer stack shared by target, drafter and adapter: returns the last output, the outputs
    of `hidden_layers`, and the cache with the new K/V written at `[lengths, lengths + T)` (lengths
    unchanged). `mask [B, T, S]` (or a `SlotVisibility`, or a `PositionPath`: exact mode) overrides the
    committed-prefix + `attend` visibility; `kernel` computes that visibility inside the Pallas
    tree-attention kernel instead."""
    if mask is None:
        mask = TreeVisibility(attend.astype(jnp.int8)) if kernel else visibility_mask(cache.lengths, attend, cache.size)
    # Traced (inside a jitted program), each layer goes through one jitted function made for this call: layers of
    # one structure and shapes are traced and lowered once, not once each (a program's Python time, under the GIL
    # while tune's compile at once, was ~2.8 s for `ar`'s round at SmolLM2's 30 layers, now ~0.9 s on a CPU); XLA
    # inlines the calls, so the program it compiles is the same. Made per call, its cache never outlives what was
    # read when it traced (the kernel selection, exact mode's tiling). Called eagerly, layers run as they are.
    if isinstance(x, jax.core.Tracer):
        jitted = jax.jit(lambda graphdef, state, *args: nnx.merge(graphdef, state)(*args), static_argnums=0)
        apply = lambda layer, *args: jitted(*nnx.split(layer), *args)  # noqa: E731
    else:
        apply = lambda layer, *args: layer(*args)  # noqa: E731
    hidden, ks, vs = {}, [], []
    for i, layer in enumerate(layers):
        x, k, v = apply(layer, x, positions, inv_freq, cache.k[i], cache.v[i], cache.lengths, mask)
        ks.append(k)
        vs.append(v)
        if i in hidden_layers:
            hidden[i] = x
    return x, tuple(hidden[i] for i in hidden_layers), KVCache(tuple(ks), tuple(vs), cache.lengths)


def module_params(module: nnx.Module) -> dict:
    """A module's parameters as flat `{"layers.0.attn.qkv": array}` (the checkpoint layout; a sharded module's
    fused columns back in order)."""
    params = flatten_params(nnx.to_pure_dict(nnx.state(module)))
    for path, sub in nnx.iter_graph(module):
        if getattr(sub, "groups", 1) > 1:  # Attention, MLP, GatedDeltaNet
            for name, (segments, axis) in sub.fused().items():
                key = ".".join(map(str, (*path, name)))
                params[key] = ungroup_columns(params[key], segments, sub.groups, axis)
    return params


def flatten_params(tree, prefix: str = "") -> dict:
    """Nested pure dict (as `nnx.to_pure_dict` gives) -> {"layers.0.attn.qkv": leaf}."""
    flat = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flatten_params(v, name + "."))
        else:
            flat[name] = v
    return flat


def target_from_params(config: ModelConfig, params: dict) -> Transformer:
    """Build a Transformer from flat `{name: array}` in the project's layout (names as
    `flatten_params` prints them), checking that every tensor is present with its shape (a clear error names
    the one missing or misshapen). What the converters end with; a round trip:

        flat = flatten_params(nnx.to_pure_dict(nnx.state(target)))  # {"embed": ..., "layers.0.attn.qkv": ...}
        same = weaver_jax.target_from_params(target.config, flat)
    """
    return module_from_params(lambda: Transformer(config, rngs=nnx.Rngs(0)), config.jnp_dtype, params)


def module_from_params(make, dtype, params: dict):
    """Any of the project's modules (`make()` builds one) from flat `{name: array}`, shapes checked."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    expected = flatten_params(nnx.to_pure_dict(state))
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    if missing or unexpected:
        raise ValueError(f"parameter set does not match the config: missing {missing}, unexpected {unexpected}")
    for name, abstract in expected.items():
        if tuple(params[name].shape) != tuple(abstract.shape):
            raise ValueError(f"{name}: expected shape {tuple(abstract.shape)}, got {tuple(params[name].shape)}")
    nested = nnx.to_pure_dict(state)

    def fill(tree, prefix=""):
        for k, v in tree.items():
            if isinstance(v, dict):
                fill(v, f"{prefix}{k}.")
            else:
                tree[k] = jnp.asarray(params[f"{prefix}{k}"], dtype)

    fill(nested)
    nnx.replace_by_pure_dict(state, nested)
    return nnx.merge(graphdef, state)
