"""DFlash-style factorized block drafter (DESIGN 3.2).

One forward over the block `[r, MASK x (b-1)]` gives a marginal distribution for each of the next
`b - 1` positions. The drafter reads fused target features of committed tokens: the target's
hidden states at `target_layer_ids`, concatenated, through a bias-free Linear and an RMSNorm.
Every drafter layer (a Qwen3-style block: q/k RMSNorm, RoPE at absolute positions) attends from
the block to `[context K/V; block K/V]`, both made with the layer's own k/v projections, and
non-causally inside the block. The context K/V live in a cache that only ever grows by committed
tokens; the block's K/V go to scratch slots past it. The drafter owns no embedding and no LM
head: it borrows the target's.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from weaver_jax._config import ModelConfig
from weaver_jax._model import Block, KVCache, _param, _write, rms_norm, rope_frequencies, run_blocks, visibility_mask


def default_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """Evenly spaced from layer 1 to L-3 (DFlash's rule: 1, 9, 17, 25, 33 for 36 layers and 5)."""
    if num_features == 1:
        return (num_target_layers // 2,)
    start, end = (1, num_target_layers - 3) if num_target_layers > 4 else (0, num_target_layers - 1)
    return tuple(round(start + i * (end - start) / (num_features - 1)) for i in range(num_features))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Drafter shape. `target_hidden_size`, `vocab_size` and `target_layer_ids` tie it to one target; `like`
    derives one from the target's config:

        DrafterConfig.like(bundle.target.config, num_layers=2, num_features=3, mask_token_id=0)  # block_size 16
    """

    target_hidden_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    mask_token_id: int = 0
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")

    @classmethod
    def like(cls, target: ModelConfig, *, num_layers: int, num_features: int, block_size: int = 16,
             mask_token_id: int, dtype: str = "float32") -> DrafterConfig:
        """A drafter with the target's width, MLP and head layout (DFlash's choice), reading
        `num_features` target layers spaced by DFlash's rule."""
        return cls(target_hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                   target_layer_ids=default_target_layer_ids(target.num_layers, num_features),
                   hidden_size=target.hidden_size, intermediate_size=target.intermediate_size, num_layers=num_layers,
                   num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   block_size=block_size, mask_token_id=mask_token_id, rope_theta=target.rope_theta,
                   rms_norm_eps=target.rms_norm_eps, dtype=dtype)

    @property
    def layer_config(self) -> ModelConfig:
        """The ModelConfig its blocks are built from (Qwen3-style: q/k norm, no bias)."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps, qk_norm=True,
            dtype=self.dtype, family="qwen3")

    def check_target(self, target: ModelConfig) -> None:
        """Raise if this drafter was built for another target."""
        problems = []
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"target width {self.target_hidden_size} != {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocabulary {self.vocab_size} != {target.vocab_size}")
        if any(not 0 <= i < target.num_layers for i in self.target_layer_ids):
            problems.append(f"target_layer_ids {self.target_layer_ids} outside the target's {target.num_layers} layers")
        if problems:
            raise ValueError("drafter does not match the target: " + "; ".join(problems))


class Drafter(nnx.Module):
    """The DFlash-style block drafter: from the target's hidden states at `config.target_layer_ids` (its context,
    kept in its own KV cache) it proposes marginals for the `block_size - 1` positions after the last token in
    one pass. `propose(target, target_cache, root [B], cache)` -> (marginal logits `[B, depth, V]`, states `[B,
    block_size - 1, D_t]`); `commit(cache, target_hidden, positions, num_new)` extends its context.

        bundle = weaver_jax.load("smollm2-135m-instruct")     # bundle.drafter: a Drafter
        bundle.drafter.config.block_size, bundle.drafter.config.target_layer_ids
    """

    def __init__(self, config: DrafterConfig, *, rngs: nnx.Rngs):
        self.config = config
        c, dt = config, jnp.dtype(config.dtype)
        features = len(c.target_layer_ids) * c.target_hidden_size
        self.fc = _param(rngs, (features, c.hidden_size), dt, features)
        self.hidden_norm = nnx.Param(jnp.ones((c.hidden_size,), dt))
        self.layers = nnx.List([Block(c.layer_config, rngs=rngs) for _ in range(c.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((c.hidden_size,), dt))
        # Only when the drafter is narrower or wider than the target: map the target's embedding in
        # and the drafter's states out to the target's LM head.
        same = c.hidden_size == c.target_hidden_size
        self.in_proj = None if same else _param(rngs, (c.target_hidden_size, c.hidden_size), dt, c.target_hidden_size)
        self.out_proj = None if same else _param(rngs, (c.hidden_size, c.target_hidden_size), dt, c.hidden_size)

    def init_cache(self, batch: int, size: int) -> KVCache:
        return KVCache.init(self.config.layer_config, batch, size)

    def context_features(self, target_hidden: tuple[jax.Array, ...]) -> jax.Array:
        """Target states at `target_layer_ids`, each `[B, C, D_t]` -> context features `[B, C, d]`."""
        x = jnp.concatenate(target_hidden, axis=-1) @ self.fc[...]
        return rms_norm(x, self.hidden_norm[...], self.config.rms_norm_eps)

    def extend(self, cache: KVCache, features: jax.Array, positions: jax.Array, num_new: jax.Array) -> KVCache:
        """Append committed tokens: features `[B, C, d]` at positions `[B, C]`; the first `num_new [B]`
        of each row are real (the rest land in free slots). Every layer projects the same features."""
        inv_freq = rope_frequencies(self.config.layer_config)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            _, k, v = layer.attn.project(features, positions, inv_freq)
            ks.append(_write(cache.k[i], k, cache.lengths))
            vs.append(_write(cache.v[i], v, cache.lengths))
        return KVCache(tuple(ks), tuple(vs), cache.lengths + num_new.astype(jnp.int32))

    def commit(self, cache: KVCache, target_hidden: tuple[jax.Array, ...], positions: jax.Array,
               num_new: jax.Array) -> KVCache:
        """Extend the context with committed tokens, from the target states at `target_layer_ids`."""
        return self.extend(cache, self.context_features(target_hidden), positions, num_new)

    def propose(self, target, target_cache: KVCache, root: jax.Array, cache: KVCache,
                depth: int | None = None) -> tuple[jax.Array, jax.Array]:
        """Marginal logits `[B, depth, V]` for the first `depth` (default b - 1) positions after
        `root [B]` (which sits at `cache.lengths`): only those states go through the LM head, the
        drafter's largest cost on a CPU. Also the drafter states `[B, b - 1, D_t]` of every position
        (the Weaver adapter's prefix). `target_cache` is unused here; test drafters that know the
        answer read it."""
        del target_cache
        block = jnp.full((root.shape[0], self.config.block_size), self.config.mask_token_id, jnp.int32)
        block = block.at[:, 0].set(root)
        states = self(jnp.take(target.embed[...], block, axis=0), cache)[:, 1:]
        return target.head(states[:, :depth]), states

    def __call__(self, block_embeds: jax.Array, cache: KVCache) -> jax.Array:
        """block_embeds `[B, b, D_t]` (the target's embedding of `[r, MASK...]`), placed at positions
        `cache.lengths + [0, b)` -> normed drafter states `[B, b, D_t]` for the target's LM head.
        The block sees the whole committed context and itself, without a causal mask."""
        b, t = block_embeds.shape[:2]
        positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
        return self._stack(block_embeds, positions, cache, visibility_mask(cache.lengths, jnp.ones((b, t, t), bool),
                                                                             cache.size))

    def _stack(self, block_embeds, positions, cache: KVCache, mask) -> jax.Array:
        x = block_embeds if self.in_proj is None else block_embeds @ self.in_proj[...]
        x, _, _ = run_blocks(self.layers, x, positions, rope_frequencies(self.config.layer_config), cache, None,
                             mask=mask)
        x = rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
        return x if self.out_proj is None else x @ self.out_proj[...]

    def train_states(self, embed: jax.Array, tokens: jax.Array, features: jax.Array, anchors: jax.Array) -> jax.Array:
        """Many blocks at once, for training (DESIGN 3.2): anchor a opens the block `[x_a, MASK...]`
        at positions a..a+b-1 that sees the context features of positions < a and its own block.
        embed `[V, D_t]` (the target's), tokens `[B, T]`, features `[B, T, d]` (context_features
        of every position), anchors `[B, A]` -> normed states `[B, A, b, D_t]`; for one anchor this
        is what `propose` computes after committing `x_0..x_{a-1}`."""
        (bsz, t), a, b = tokens.shape, anchors.shape[1], self.config.block_size
        positions = jnp.broadcast_to(jnp.arange(t), (bsz, t))
        cache = self.extend(self.init_cache(bsz, t + a * b), features, positions, jnp.full((bsz,), t))
        block = jnp.full((bsz, a, b), self.config.mask_token_id, jnp.int32)
        block = block.at[:, :, 0].set(jnp.take_along_axis(tokens, anchors, axis=1))
        x = jnp.take(embed, block.reshape(bsz, a * b), axis=0)
        block_positions = (anchors[:, :, None] + jnp.arange(b)).reshape(bsz, a * b)
        sees_context = jnp.repeat(jnp.arange(t)[None, None, :] < anchors[:, :, None], b, axis=1)  # [B, A*b, T]
        block_of = jnp.arange(a * b) // b
        same_block = jnp.broadcast_to(block_of[:, None] == block_of[None, :], (bsz, a * b, a * b))
        mask = jnp.concatenate([sees_context, same_block], axis=2)
        return self._stack(x, block_positions, cache, mask).reshape(bsz, a, b, -1)


def random_drafter_config(target: ModelConfig, *, num_layers: int = 2, block_size: int = 8,
                          hidden_size: int | None = None, num_features: int | None = None,
                          mask_token_id: int | None = None) -> DrafterConfig:
    """A small drafter shaped for `target` (tests, examples)."""
    width = hidden_size or target.hidden_size
    heads = max(2, width // 16)
    return DrafterConfig(
        target_hidden_size=target.hidden_size, vocab_size=target.vocab_size,
        target_layer_ids=default_target_layer_ids(
            target.num_layers, num_features or min(num_layers, target.num_layers)),
        hidden_size=width, intermediate_size=2 * width, num_layers=num_layers, num_heads=heads,
        num_kv_heads=heads // 2 if heads % 2 == 0 else heads, head_dim=max(8, 2 * math.ceil(width / heads / 2)),
        block_size=block_size, mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        rope_theta=target.rope_theta, rms_norm_eps=target.rms_norm_eps, dtype=target.dtype)
