"""The Qwen3.5 hybrid target (issue 20): Gated DeltaNet layers (`weaver_jax._gdn`) and gated full
attention in a `layer_types` schedule, with a static-shape cache holding K/V for the attention layers
and recurrent + conv states for the GDN layers.

Three calls, as the speculative round uses them: `prefill` (right-padded ragged prompts: K/V written,
GDN states committed for each prompt's real tokens, lengths advanced); `verify` (a tree, or one decode
token, at depths past the committed length: every node's logits along its own path, K/V written to
scratch slots, no GDN state touched); `commit` (the accepted path: its K/V moved into place, only its
tokens folded into the GDN states, lengths advanced). A rejected branch leaves nothing to undo.

Qwen3.5's conventions: RMSNorms scale by (1 + weight); attention's q projection carries an output gate
interleaved per head (query, then gate), q / k are normed per head before a partial rotary embedding
(the first `partial_rotary_factor` of each head, halves rotated), and the output is multiplied by
sigmoid(gate) before its projection. Weights `[in, out]`.

Not yet wired into `generate` (the round's commit and the drafter's layer choice for hybrid targets
come next); `HybridConfig` will join `ModelConfig` then.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from weaver_jax._gdn import GatedDeltaNet, GDNPending, GDNState
from weaver_jax._model import MLP, KVCache, _param, _write, apply_rope, causal_attend, gqa_attention, visibility_mask
from weaver_jax._speculative import commit_kv


@dataclasses.dataclass(frozen=True)
class HybridConfig:
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
    dtype: str = "float32"

    def __post_init__(self):
        unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unknown layer types {sorted(unknown)}")
        if self.num_heads % self.num_kv_heads or self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("query heads must group over K/V heads, value heads over key heads")

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
class HybridCache:
    """K/V `[B, S, H_kv, D]` per attention layer, a `GDNState` per GDN layer (in layer order within each
    kind), committed lengths `[B]`."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    gdn: tuple[GDNState, ...]
    lengths: jax.Array

    @property
    def size(self) -> int:
        return self.k[0].shape[1] if self.k else 0


def zero_centered_rms_norm(x, weight, eps: float):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * (1 + weight.astype(jnp.float32))
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
        c = self.config
        b, t, _ = x.shape
        h, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
        q, gate = jnp.split((x @ self.q_gate[...]).reshape(b, t, h, 2 * d), 2, axis=-1)
        q = partial_rope(zero_centered_rms_norm(q, self.q_norm[...], c.rms_norm_eps), positions, c)
        k = partial_rope(zero_centered_rms_norm((x @ self.k[...]).reshape(b, t, kv, d), self.k_norm[...],
                                                c.rms_norm_eps), positions, c)
        v = (x @ self.v[...]).reshape(b, t, kv, d)
        k_cache, v_cache = _write(k_cache, k, lengths), _write(v_cache, v, lengths)
        o = gqa_attention(q.reshape(b, t, kv, h // kv, d), k_cache, v_cache, mask).reshape(b, t, h * d)
        o = (o * jax.nn.sigmoid(gate.reshape(b, t, h * d).astype(jnp.float32))).astype(x.dtype)
        return o @ self.out[...], k_cache, v_cache


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

    def finish(self, x, mixed):
        x = x + mixed
        return x + self.mlp(zero_centered_rms_norm(x, self.mlp_norm[...], self.eps))


class HybridTransformer(nnx.Module):
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
                           tuple(layer.mixer.init_state(batch) for layer in self.layers
                                 if layer.kind == "linear_attention"), jnp.zeros((batch,), jnp.int32))

    def logits(self, x):
        h = zero_centered_rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)

    def _run(self, tokens, positions, cache: HybridCache, attend, gdn_call):
        """The layer stack: `gdn_call(layer, x, state)` runs a GDN layer -> (out, per-layer result)."""
        mask = visibility_mask(cache.lengths, attend, cache.size)
        x = jnp.take(self.embed[...], tokens, axis=0)
        ks, vs, results = list(cache.k), list(cache.v), []
        a = 0
        for layer in self.layers:
            normed = zero_centered_rms_norm(x, layer.input_norm[...], layer.eps)
            if layer.kind == "full_attention":
                mixed, ks[a], vs[a] = layer.mixer(normed, positions, ks[a], vs[a], mask, cache.lengths)
                a += 1
            else:
                mixed, result = gdn_call(layer.mixer, normed, cache.gdn[len(results)])
                results.append(result)
            x = layer.finish(x, mixed)
        return x, tuple(ks), tuple(vs), tuple(results)

    def prefill(self, tokens, cache: HybridCache, lengths):
        """Right-padded prompts `[B, T]` after the committed tokens, `lengths [B]` real: -> (logits
        `[B, T, V]` float32, the cache with every real token committed)."""
        b, t = tokens.shape
        positions = cache.lengths[:, None] + jnp.arange(t)
        x, ks, vs, states = self._run(tokens, positions, cache, causal_attend(b, t),
                                      lambda gdn, x, state: gdn.prefill(x, state, lengths))
        return self.logits(x), HybridCache(ks, vs, states, cache.lengths + lengths)

    def verify(self, tokens, depth, cache: HybridCache, ancestors):
        """A tree `[B, T]` at `depth [B, T]` past the committed length, ancestors-or-self `[B, T, T]`: ->
        (logits `[B, T, V]` float32, the cache with the nodes' K/V at scratch slots `[len, len + T)` and
        its GDN states untouched, what `commit` folds)."""
        x, ks, vs, pending = self._run(tokens, cache.lengths[:, None] + depth, cache, ancestors,
                                       lambda gdn, x, state: gdn(x, state, depth, ancestors))
        return self.logits(x), HybridCache(ks, vs, cache.gdn, cache.lengths), pending

    def commit(self, cache: HybridCache, pending: tuple[GDNPending, ...], path_nodes, length) -> HybridCache:
        """The accepted path, node indices `path_nodes [B, P]` root first, its first `length [B]`: K/V
        moved to `[len, len + P)`, GDN states folded along it, lengths advanced by `length`."""
        moved = commit_kv(KVCache(cache.k, cache.v, cache.lengths), path_nodes)
        gdn_layers = [layer.mixer for layer in self.layers if layer.kind == "linear_attention"]
        states = tuple(gdn.commit(state, p, path_nodes, length)
                       for gdn, state, p in zip(gdn_layers, cache.gdn, pending, strict=True))
        return HybridCache(moved.k, moved.v, states, cache.lengths + length)


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
