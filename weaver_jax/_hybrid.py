"""The Qwen3.5 hybrid target (issue 20): Gated DeltaNet layers (`weaver_jax._gdn`) and gated full
attention in a `layer_types` schedule, with a static-shape cache holding K/V for the attention layers
and recurrent + conv states for the GDN layers.

The target protocol the generation loops use (`Transformer` has the same three calls): `prefill`
(right-padded ragged prompts: K/V written, GDN states committed for each prompt's real tokens, lengths
advanced); the forward `__call__` (a tree, or one decode token, at depths past the committed length:
every node's logits along its own path, K/V written to scratch slots, no GDN state touched, `pending`
returned); `commit` (after the accepted path's K/V are moved into place: only its tokens folded into the
GDN states, lengths advanced). A rejected branch leaves nothing to undo.

Qwen3.5's conventions: RMSNorms scale by (1 + weight); attention's q projection carries an output gate
interleaved per head (query, then gate), q / k are normed per head before a partial rotary embedding
(the first `partial_rotary_factor` of each head, halves rotated), and the output is multiplied by
sigmoid(gate) before its projection. Weights `[in, out]`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from weaver_jax._gdn import GatedDeltaNet, GDNPending, GDNState
from weaver_jax._model import (
    MLP,
    ForwardOutput,
    KVCache,
    PositionPath,
    _param,
    _write,
    apply_rope,
    causal_attend,
    dense,
    gqa_attention,
    mean_square,
    per_head_kernel,
    position_path,
    row_invariant_product,
    visibility_mask,
)
from weaver_jax.pallas_kernels import interpret


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """A hybrid target's shape: `layer_types` ("linear_attention" for Gated DeltaNet, "full_attention") per layer,
    the gated attention's heads and the GDN's key / value heads. `qwen3_6_27b()` gives the Qwen3.6-27B shape;
    `weaver_jax.convert.hf.hybrid_config_from_hf` reads a Hugging Face config.json.

        from weaver_jax._hybrid import qwen3_6_27b, qwen_layer_types
        config = qwen3_6_27b(layer_types=qwen_layer_types(8))    # two of its four-layer groups, bfloat16
        config.layer_types[:4]                                   # 3 x "linear_attention", then "full_attention"
        weaver_jax.HybridTransformer(config, rngs=nnx.Rngs(0))   # random weights
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int = 262_144
    dtype: str = "float32"

    def __post_init__(self):
        unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unknown layer types {sorted(unknown)}")
        if self.num_heads % self.num_kv_heads or self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("query heads must group over K/V heads, value heads over key heads")

    family = "qwen3_5"

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache(KVCache):
    """A `KVCache` whose K/V `[B, S, H_kv, D]` are the attention layers' only, plus a `GDNState` per GDN
    layer (both in layer order within their kind); committed lengths `[B]`. Everything that moves K/V
    (`commit_kv`, the acceptance kernel) replaces k and v and keeps the states.

        cache = hybrid_bundle.target.init_cache(batch=2, size=512)       # a HybridCache
        len(cache.k), len(cache.gdn), cache.lengths                      # attention layers, GDN layers, [2]
    """

    gdn: tuple[GDNState, ...]

    @property
    def size(self) -> int:  # with no attention layer there are no slots to run out of
        return self.k[0].shape[1] if self.k else np.iinfo(np.int32).max


def zero_centered_rms_norm(x, weight, eps: float, exact: bool = False):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(mean_square(x32, exact) + eps) * (1 + weight.astype(jnp.float32))
    return y.astype(x.dtype)


def partial_rope(x, positions, config: HybridConfig):
    """Rotate the first `rotary_dim` features of each head `[B, T, H, D]` by split halves."""
    rot = config.rotary_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    return jnp.concatenate([apply_rope(x[..., :rot], positions, inv_freq), x[..., rot:]], axis=-1)


class GatedAttention(nnx.Module):
    def __init__(self, c: HybridConfig, *, rngs: nnx.Rngs):
        dt = c.jnp_dtype
        self.config = c
        self.q_gate = _param(rngs, (c.hidden_size, c.num_heads * 2 * c.head_dim), dt, c.hidden_size)
        self.k = _param(rngs, (c.hidden_size, c.num_kv_heads * c.head_dim), dt, c.hidden_size)
        self.v = _param(rngs, (c.hidden_size, c.num_kv_heads * c.head_dim), dt, c.hidden_size)
        self.q_norm = nnx.Param(jnp.zeros((c.head_dim,), dt))
        self.k_norm = nnx.Param(jnp.zeros((c.head_dim,), dt))
        self.out = _param(rngs, (c.num_heads * c.head_dim, c.hidden_size), dt, c.num_heads * c.head_dim)

    def __call__(self, x, positions, k_cache, v_cache, mask, lengths):
        """mask `[B, T, S]`, or a `PositionPath`: exact mode (row-invariant products and attention by position)."""
        c = self.config
        b, t, _ = x.shape
        h, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
        exact = isinstance(mask, PositionPath)
        q, gate = jnp.split(dense(x, self.q_gate[...], exact, split="columns").reshape(b, t, h, 2 * d), 2, axis=-1)
        q = partial_rope(zero_centered_rms_norm(q, self.q_norm[...], c.rms_norm_eps, exact), positions, c)
        k = partial_rope(zero_centered_rms_norm(dense(x, self.k[...], exact, split="columns").reshape(b, t, kv, d),
                                                self.k_norm[...], c.rms_norm_eps, exact), positions, c)
        v = dense(x, self.v[...], exact, split="columns").reshape(b, t, kv, d)
        k_cache, v_cache = _write(k_cache, k, lengths), _write(v_cache, v, lengths)
        if exact:
            from weaver_jax.pallas_kernels.row_invariant import attention

            o = per_head_kernel(lambda *a: attention(*a, interpret=interpret()), kv, (q, k_cache, v_cache),
                                (positions, lengths, mask.path))
        else:
            o = gqa_attention(q.reshape(b, t, kv, h // kv, d), k_cache, v_cache, mask)
        o = (o.reshape(b, t, h * d) * jax.nn.sigmoid(gate.reshape(b, t, h * d).astype(jnp.float32))).astype(x.dtype)
        return dense(o, self.out[...], exact, split="rows"), k_cache, v_cache


class HybridLayer(nnx.Module):
    def __init__(self, c: HybridConfig, kind: str, *, rngs: nnx.Rngs):
        dt = c.jnp_dtype
        self.kind = kind
        self.eps = c.rms_norm_eps
        self.input_norm = nnx.Param(jnp.zeros((c.hidden_size,), dt))
        self.mixer = GatedAttention(c, rngs=rngs) if kind == "full_attention" else GatedDeltaNet(
            c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
            c.linear_value_head_dim, c.linear_conv_kernel_dim, c.rms_norm_eps, dt, rngs=rngs)
        self.mlp_norm = nnx.Param(jnp.zeros((c.hidden_size,), dt))
        self.mlp = MLP(c, rngs=rngs)  # reads hidden_size, intermediate_size, jnp_dtype

    def finish(self, x, mixed, exact: bool = False):
        x = x + mixed
        return x + self.mlp(zero_centered_rms_norm(x, self.mlp_norm[...], self.eps, exact), exact)


class HybridTransformer(nnx.Module):
    """A Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid target: Gated DeltaNet and gated full-attention layers in
    `config.layer_types` order, with `Transformer`'s protocol (`init_cache`, `prefill`, the forward over a tree
    or a decode token, `commit` of the accepted path) over a `HybridCache`. Loaded from a Hugging Face directory
    (`weaver_jax.load("path/to/Qwen3.5")`) or random for tests:

        bundle = weaver_jax.testing.random_bundle(0, family="qwen3_5")
        weaver_jax.generate(bundle, [[1, 2, 3]], method="weaver", max_new_tokens=8).tokens
    """

    def __init__(self, config: HybridConfig, *, rngs: nnx.Rngs):
        self.config = config
        dt = config.jnp_dtype
        self.embed = _param(rngs, (config.vocab_size, config.hidden_size), dt, config.hidden_size)
        self.layers = nnx.List([HybridLayer(config, kind, rngs=rngs) for kind in config.layer_types])
        self.final_norm = nnx.Param(jnp.zeros((config.hidden_size,), dt))
        self.lm_head = None if config.tie_embeddings else _param(
            rngs, (config.hidden_size, config.vocab_size), dt, config.hidden_size)

    def init_cache(self, batch: int, size: int) -> HybridCache:
        c = self.config
        attention = c.layer_types.count("full_attention")
        zeros = lambda: jnp.zeros((batch, size, c.num_kv_heads, c.head_dim), c.jnp_dtype)  # noqa: E731
        return HybridCache(tuple(zeros() for _ in range(attention)), tuple(zeros() for _ in range(attention)),
                           jnp.zeros((batch,), jnp.int32), tuple(layer.mixer.init_state(batch) for layer in self.layers
                                                                 if layer.kind == "linear_attention"))

    def final_state(self, h, exact: bool = False):
        """The final norm of last-layer outputs `[..., D]` (what the LM head reads)."""
        return zero_centered_rms_norm(h, self.final_norm[...], self.config.rms_norm_eps, exact)

    def head(self, h, exact: bool = False):
        """The LM head alone: `[..., D] -> [..., V]` float32 (exact: the row-invariant product)."""
        tied = self.lm_head is None
        w = self.embed[...] if tied else self.lm_head[...]
        if exact:
            return row_invariant_product(h, w, None if tied else "columns", tied)
        return jnp.einsum("...d,dv->...v", h, w.T if tied else w, preferred_element_type=jnp.float32)

    def logits(self, x):
        return self.head(self.final_state(x))

    def _run(self, tokens, positions, cache: HybridCache, attend, hidden_layers, exact, gdn_call):
        """The layer stack: `gdn_call(layer, x, state)` runs a GDN layer -> (out, per-layer result). exact: every
        product, norm and reduction row-invariant, attention by position (`Transformer`'s exact mode) and the GDN
        layers' recurrence token by token (`weaver_jax._gdn`)."""
        if any(not 0 <= i < self.config.num_layers for i in hidden_layers):
            raise ValueError(f"hidden_layers {hidden_layers} outside [0, {self.config.num_layers})")
        if not cache.k:  # attention layers only
            mask = None
        elif exact:
            mask = PositionPath(position_path(positions, cache.lengths, attend))
        else:
            mask = visibility_mask(cache.lengths, attend, cache.size)
        x = jnp.take(self.embed[...], tokens, axis=0)
        ks, vs, results, hidden = list(cache.k), list(cache.v), [], {}
        a = 0
        for i, layer in enumerate(self.layers):
            normed = zero_centered_rms_norm(x, layer.input_norm[...], layer.eps, exact)
            if layer.kind == "full_attention":
                mixed, ks[a], vs[a] = layer.mixer(normed, positions, ks[a], vs[a], mask, cache.lengths)
                a += 1
            else:
                mixed, result = gdn_call(layer.mixer, normed, cache.gdn[len(results)])
                results.append(result)
            x = layer.finish(x, mixed, exact)
            if i in hidden_layers:
                hidden[i] = x
        return x, tuple(hidden[i] for i in hidden_layers), tuple(ks), tuple(vs), tuple(results)

    def _output(self, x, hidden, cache, logits_rows, pending=(), exact: bool = False):
        if exact:  # rows picked after the norm, as `Transformer` does (what XLA fuses there stays the same)
            x = self.final_state(x, exact=True)
            if logits_rows is not None:
                x = jnp.take_along_axis(x, logits_rows[..., None], axis=1)
            return ForwardOutput(self.head(x, exact=True), hidden, cache, pending)
        if logits_rows is not None:
            x = jnp.take_along_axis(x, logits_rows[..., None], axis=1)
        return ForwardOutput(self.logits(x), hidden, cache, pending)

    def prefill(self, tokens, cache: HybridCache, lengths, *, logits_rows=None, hidden_layers=(),
                exact: bool = False) -> ForwardOutput:
        """Right-padded prompts `[B, T]` after the committed tokens, `lengths [B]` real: the forward (GDN
        layers by the chunked form) with every real token committed (K/V, GDN states, lengths)."""
        b, t = tokens.shape
        positions = cache.lengths[:, None] + jnp.arange(t)
        x, hidden, ks, vs, states = self._run(tokens, positions, cache, causal_attend(b, t), hidden_layers, exact,
                                              lambda gdn, x, state: gdn.prefill(x, state, lengths, exact=exact))
        return self._output(x, hidden, HybridCache(ks, vs, cache.lengths + lengths, states), logits_rows,
                            exact=exact)

    def __call__(self, tokens, positions, cache: HybridCache, attend=None, *, logits_rows=None, hidden_layers=(),
                 exact: bool = False) -> ForwardOutput:
        """A tree (or one decode token) `[B, T]` at `positions` = committed length + depth, `attend`
        ancestors-or-self `[B, T, T]` (None: a causal chain): every node's logits along its own path, its
        K/V at scratch slots `[len, len + T)`, the GDN states untouched; `pending` is what `commit` folds."""
        b, t = tokens.shape
        attend = causal_attend(b, t) if attend is None else attend
        depth = positions - cache.lengths[:, None]
        x, hidden, ks, vs, pending = self._run(tokens, positions, cache, attend, hidden_layers, exact,
                                               lambda gdn, x, state: gdn(x, state, depth, attend, exact))
        return self._output(x, hidden, dataclasses.replace(cache, k=ks, v=vs), logits_rows, pending, exact)

    def commit(self, cache: HybridCache, pending: tuple[GDNPending, ...], path, count) -> HybridCache:
        """After `__call__`, with the accepted nodes' K/V already in place (`commit_kv` or the acceptance
        kernel): fold the first `count [B]` nodes of `path [B, P]` (node indices, root first) into the GDN
        states - rejected branches never touch them - and advance the lengths by `count`."""
        gdn_layers = [layer.mixer for layer in self.layers if layer.kind == "linear_attention"]
        states = tuple(gdn.commit(state, p, path, count)
                       for gdn, state, p in zip(gdn_layers, cache.gdn, pending, strict=True))
        return dataclasses.replace(cache, gdn=states, lengths=cache.lengths + count)


def qwen_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    """Qwen's hybrid schedule (transformers' default): full attention at every `interval`-th layer, Gated
    DeltaNet elsewhere."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))


def qwen3_6_27b(dtype: str = "bfloat16", **changes) -> HybridConfig:
    """The Qwen3.6-27B (= Qwen3.5-27B) text shape: 64 layers, every fourth full attention (24 query / 4 K/V
    heads of 256, a quarter rotated), the other 48 Gated DeltaNet (16 key / 48 value heads of 128, conv 4),
    width 5120, MLP 17408, vocabulary 248320, LM head untied. For benchmarks with random weights."""
    return HybridConfig(**{**dict(
        vocab_size=248_320, hidden_size=5120, intermediate_size=17_408,
        layer_types=qwen_layer_types(64),
        num_heads=24, num_kv_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, dtype=dtype), **changes})


def random_hybrid(seed: int = 0, **changes) -> HybridTransformer:
    """A small random hybrid target (both layer kinds) with non-trivial norms, for tests."""
    config = HybridConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=48,
                                    layer_types=("linear_attention", "full_attention", "linear_attention"),
                                    num_heads=2, num_kv_heads=1, head_dim=16, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                    rope_theta=10_000.0), **changes})
    model = HybridTransformer(config, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param) and path[-1] in ("input_norm", "mlp_norm", "final_norm", "q_norm", "k_norm",
                                                         "norm"):
            key, sub = jax.random.split(key)
            param[...] = (0.2 * jax.random.normal(sub, param.shape) + (1 if path[-1] == "norm" else 0)).astype(
                param.dtype)
    return model
