"""The Weaver adapter (DESIGN 3.3): re-scores the drafter's top-P candidates along each tree path.

Per round it reads a prefix `[target state that produced the root, drafter states h_1..h_K]`
(`1 + K` tokens, causal, positions 0..K) and keeps its K/V. A node step for a node at depth t
with token x feeds `token_table[x]` at position t + 1 through the same blocks, attending to the
prefix, the node's ancestors and itself; its normed state u scores the children over the pool of
depth t + 1: `drafter_logits[pool] + candidate_table[pool] . u`, normalised over the pool only.
The adapter never projects to the vocabulary: both tables are `[V, d]` lookups computed once per
generation call, and a node step touches P rows of them.

Blocks reuse the target's pre-norm block (causal self-attention with RoPE, SwiGLU) with the
published checkpoint layout's extras: every RMSNorm has a bias (`y * weight + bias`), the MLP's
gate/up and down projections have biases, qkv and out do not. Input and output maps follow the same
layout: `embed_norm` + `token_in` (with bias) for tokens, `output_norm` + `proposal_in` (with bias)
for target/drafter states, `out_norm` + `query` (the published `lm_head_query_in`, W_q: d -> D, no
bias) for the residual. The root is expanded by an explicit node step, as
in Mirai's JAX port of the published implementation.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from weaver_jax._config import ModelConfig
from weaver_jax._model import Block, KVCache, SlotVisibility, _param, rms_norm, rope_frequencies, run_blocks
from weaver_jax._tree import Tree, batched_best_first, chunked_top_k, extend_deepest, row_get, row_set
from weaver_jax.pallas_kernels import kernels_enabled


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """Names as in the published checkpoints: d_model (target width), d_embed (target embedding
    width), d_rank (adapter width), K (max depth), candidate_pool_size (P). The shipped SmolLM2 adapter's:

        AdapterConfig(d_model=576, d_embed=576, d_rank=384, num_layers=2, num_heads=6, mlp_dim=1024, K=15)
        weaver_jax.Adapter(config, rngs=nnx.Rngs(0))  # a fresh one to train (`weaver-jax train-adapter`)
    """

    d_model: int
    d_embed: int
    d_rank: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    K: int  # noqa: N815  (the published field name)
    candidate_pool_size: int = 512
    rope_base: float = 10_000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self):
        if self.d_rank % self.num_heads or (self.d_rank // self.num_heads) % 2:
            raise ValueError(f"d_rank={self.d_rank} must split into {self.num_heads} heads of even width")

    @classmethod
    def like(cls, target: ModelConfig, *, d_rank: int, num_layers: int, num_heads: int, mlp_dim: int, K: int,  # noqa: N803
             candidate_pool_size: int = 512, dtype: str = "float32") -> AdapterConfig:
        """An adapter reading `target`'s states and embeddings (widths and norm epsilon from it; the
        pool capped at its vocabulary)."""
        return cls(d_model=target.hidden_size, d_embed=target.hidden_size, d_rank=d_rank, num_layers=num_layers,
                   num_heads=num_heads, mlp_dim=mlp_dim, K=K,
                   candidate_pool_size=min(candidate_pool_size, target.vocab_size),
                   rms_norm_eps=target.rms_norm_eps, dtype=dtype)

    @property
    def block_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=1, hidden_size=self.d_rank, intermediate_size=self.mlp_dim, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_heads, head_dim=self.d_rank // self.num_heads,
            rope_theta=self.rope_base, rms_norm_eps=self.rms_norm_eps, dtype=self.dtype)

    def check_target(self, target: ModelConfig) -> None:
        if self.d_model != target.hidden_size or self.d_embed != target.hidden_size:
            raise ValueError(f"adapter does not match the target: d_model={self.d_model}, d_embed={self.d_embed}, "
                             f"target width {target.hidden_size}")


class Tables(NamedTuple):
    token: jax.Array  # [V, d]: token_in(embed_norm(E))
    candidate: jax.Array  # [V, d]: W @ W_q^T, so candidate[pool] . u = W[pool] . W_q(u)


class Adapter(nnx.Module):
    """The Weaver adapter: a small autoregressive model over the drafter's top candidates that scores each
    node's children given its ancestors, so a best-first search builds a tree that respects how tokens depend on
    each other. `tables(target)` -> its two `[V, d]` tables for a target; `weaver_tree` (`weaver_jax._adapter`)
    runs the search. Loaded with a bundle (`load(..., adapter=...)`) or trained (`weaver-jax train-adapter`):

        bundle = weaver_jax.load("smollm2-135m-instruct")     # bundle.adapter: an Adapter
        bundle.adapter.config.candidate_pool_size, bundle.adapter.config.K
    """

    def __init__(self, config: AdapterConfig, *, rngs: nnx.Rngs):
        self.config = config
        c, dt = config, jnp.dtype(config.dtype)
        self.embed_norm = nnx.Param(jnp.ones((c.d_embed,), dt))
        self.embed_norm_bias = nnx.Param(jnp.zeros((c.d_embed,), dt))
        self.token_in = _param(rngs, (c.d_embed, c.d_rank), dt, c.d_embed)
        self.token_in_bias = nnx.Param(jnp.zeros((c.d_rank,), dt))
        self.output_norm = nnx.Param(jnp.ones((c.d_model,), dt))
        self.output_norm_bias = nnx.Param(jnp.zeros((c.d_model,), dt))
        self.proposal_in = _param(rngs, (c.d_model, c.d_rank), dt, c.d_model)
        self.proposal_in_bias = nnx.Param(jnp.zeros((c.d_rank,), dt))
        self.layers = nnx.List([Block(c.block_config, rngs=rngs, norm_bias=True, mlp_bias=True)
                                for _ in range(c.num_layers)])
        self.out_norm = nnx.Param(jnp.ones((c.d_rank,), dt))
        self.out_norm_bias = nnx.Param(jnp.zeros((c.d_rank,), dt))
        self.query = _param(rngs, (c.d_rank, c.d_model), dt, c.d_rank)

    def tables(self, target) -> Tables:
        """The two `[V, d]` tables, from the target's frozen embedding and LM head (once per call)."""
        eps = self.config.rms_norm_eps
        token = rms_norm(target.embed[...], self.embed_norm[...], eps, self.embed_norm_bias[...]) @ self.token_in[...]
        token = token + self.token_in_bias[...]
        head = target.embed[...] if target.lm_head is None else target.lm_head[...].T  # [V, D]
        return Tables(token, head @ self.query[...].T)

    def prefix(self, root_state: jax.Array, drafter_states: jax.Array, cache: KVCache) -> KVCache:
        """root_state `[B, D]` (the target's final normed state that produced the root),
        drafter_states `[B, K, D]` -> cache with the prefix K/V in slots `[0, K + 1)`, lengths K + 1."""
        x = self._prefix_inputs(root_state, drafter_states)
        b, t = x.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        cache = cache.with_lengths(jnp.zeros((b,), jnp.int32))
        _, _, cache = run_blocks(self.layers, x, positions, rope_frequencies(self.config.block_config), cache,
                                 jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)))
        return cache.with_lengths(jnp.full((b,), t, jnp.int32))

    def _prefix_inputs(self, root_state: jax.Array, drafter_states: jax.Array) -> jax.Array:
        x = jnp.concatenate([root_state[:, None], drafter_states], axis=1)
        x = rms_norm(x, self.output_norm[...], self.config.rms_norm_eps, self.output_norm_bias[...])
        return x @ self.proposal_in[...] + self.proposal_in_bias[...]

    def teacher_forced(self, tables: Tables, root_state: jax.Array, drafter_states: jax.Array,
                       path: jax.Array) -> jax.Array:
        """Training: the node states along one path, all in one pass. root_state `[R, D]`,
        drafter_states `[R, K, D]`, path `[R, K]` (the root's token, then the tokens at depths
        1..K-1) -> u `[R, K, d]`, node t's state that scores the pool of depth t + 1. Equal to the
        prefix + node steps of `weaver_tree` along that path: node t at position t + 1 sees the whole
        prefix and nodes 0..t."""
        r, k = path.shape
        x = jnp.concatenate([self._prefix_inputs(root_state, drafter_states), jnp.take(tables.token, path, axis=0)],
                            axis=1)
        positions = jnp.broadcast_to(jnp.concatenate([jnp.arange(k + 1), jnp.arange(k) + 1]), (r, 2 * k + 1))
        prefix_rows = jnp.concatenate([jnp.tril(jnp.ones((k + 1, k + 1), bool)), jnp.zeros((k + 1, k), bool)], 1)
        node_rows = jnp.concatenate([jnp.ones((k, k + 1), bool), jnp.tril(jnp.ones((k, k), bool))], 1)
        attend = jnp.broadcast_to(jnp.concatenate([prefix_rows, node_rows]), (r, 2 * k + 1, 2 * k + 1))
        cache = KVCache.init(self.config.block_config, r, 2 * k + 1)
        h, _, _ = run_blocks(self.layers, x, positions, rope_frequencies(self.config.block_config), cache, attend)
        return self._out(h[:, k + 1 :])

    def node_states(self, tables: Tables, cache: KVCache, tokens, depth, slot0, visible) -> tuple[jax.Array, KVCache]:
        """Node steps for w nodes per sequence: tokens, depth `[B, w]`; their K/V go to slots
        `slot0 [B] + [0, w)`; visible `[B, w, S]` (prefix, ancestors, self). -> u `[B, w, d]`, cache."""
        x = jnp.take(tables.token, tokens, axis=0)
        h, _, cache = run_blocks(self.layers, x, depth + 1, rope_frequencies(self.config.block_config),
                                 cache.with_lengths(slot0), None, mask=visible)
        return self._out(h), cache

    def _out(self, h: jax.Array) -> jax.Array:
        return rms_norm(h, self.out_norm[...], self.config.rms_norm_eps, self.out_norm_bias[...])


class WeaverState(NamedTuple):
    cache: KVCache  # prefix in [0, K + 1), node i's K/V in slot K + 1 + i
    ancestors: jax.Array  # [B, N, N] bool, rows filled as nodes are expanded


def adapter_children(adapter: Adapter, tables: Tables, pool_ids: jax.Array, pool_logits: jax.Array,
                     prefix_len: int):
    """The path-dependent child scorer for `batched_best_first`. pool_ids, pool_logits `[B, K, P]`:
    the drafter's top-P candidates per depth and their logits."""
    k = pool_ids.shape[1]
    head_dim = adapter.config.d_rank // adapter.config.num_heads
    slot_kernel = kernels_enabled("adapter_attention") and head_dim >= 16 and head_dim & (head_dim - 1) == 0
    if slot_kernel:
        from weaver_jax.pallas_kernels.adapter_attention import visible_slots

    def score(state: WeaverState, tree: Tree, nodes: jax.Array, width: int):
        b, w = nodes.shape
        n = tree.size
        with jax.named_scope("node_step"):  # a profile's sub-stages of the tree (bench/round_profile.py)
            parent = jnp.take_along_axis(tree.parent, nodes, axis=1)
            inherited = jnp.where((parent >= 0)[:, :, None], row_get(state.ancestors, jnp.maximum(parent, 0)), False)
            own = inherited | jax.nn.one_hot(nodes, n, dtype=bool)  # [B, w, N]
            ancestors = row_set(state.ancestors, nodes, own)
            if slot_kernel:
                visible = SlotVisibility(visible_slots(own, prefix_len, max_depth=k))
            else:
                visible = jnp.concatenate([jnp.ones((b, w, prefix_len), bool), own], axis=2)
            depth = jnp.take_along_axis(tree.depth, nodes, axis=1)
            u, cache = adapter.node_states(tables, state.cache, jnp.take_along_axis(tree.tokens, nodes, axis=1),
                                           depth, prefix_len + nodes[:, 0], visible)
        with jax.named_scope("children"):
            d = jnp.clip(depth, 0, k - 1)
            ids = row_get(pool_ids, d)  # [B, w, P]
            residual = jnp.einsum("bwpd,bwd->bwp", jnp.take(tables.candidate, ids, axis=0), u,
                                  preferred_element_type=jnp.float32)
            logp = jax.nn.log_softmax(row_get(pool_logits, d).astype(jnp.float32) + residual, -1)
            top, rank = jax.lax.top_k(logp, width)
        return jnp.take_along_axis(ids, rank, axis=2), top, WeaverState(cache, ancestors)

    return score


def random_adapter_config(target: ModelConfig, *, depth: int, d_rank: int = 32, num_layers: int = 2,
                          pool: int | None = None) -> AdapterConfig:
    """A small adapter for `target` (tests, examples): heads of 32, the smallest that the search kernels take."""
    return AdapterConfig.like(target, d_rank=d_rank, num_layers=num_layers, num_heads=max(1, d_rank // 32),
                              mlp_dim=2 * d_rank, K=depth, candidate_pool_size=pool or 512, dtype=target.dtype)


def weaver_tree(adapter: Adapter, tables: Tables, root: jax.Array, root_state: jax.Array, drafter_states: jax.Array,
                marginal_logits: jax.Array, *, budget: int, children: int, expansions: int, pool_size: int,
                marginal_tail: int = 0, root_children: int | None = None) -> Tree:
    """The Weaver proposal tree: batched best-first over the adapter's path-conditioned scores for
    `budget - marginal_tail` nodes, then `marginal_tail` nodes continuing the deepest along the
    drafter's argmax (`extend_deepest`). root `[B]`, root_state `[B, D]`, drafter_states
    `[B, K, D]` (the prefix: the adapter's K), marginal_logits `[B, depth, V]` (depth <= K: the
    tree's deepest level). With the "weaver_search" kernels on and an adapter they fit, the search
    runs in them (two launches per adapter call instead of ~50 XLA kernels); the same tree up to
    rounding."""
    from weaver_jax.pallas_kernels import interpret, weaver_search

    b, depth, _ = marginal_logits.shape
    prefix_len = drafter_states.shape[1] + 1
    searched = budget - marginal_tail
    fused = kernels_enabled("weaver_search") and weaver_search.fits(adapter.config)
    with jax.named_scope("pool"):
        pool_logits, pool_ids = chunked_top_k(marginal_logits.astype(jnp.float32), pool_size)
    with jax.named_scope("prefix"):
        size = weaver_search.cache_size(prefix_len, searched, expansions) if fused else prefix_len + 1 + searched
        cache = adapter.prefix(root_state, drafter_states, KVCache.init(adapter.config.block_config, b, size))
    if fused:
        tree = weaver_search.weaver_search(adapter, tables, cache, root, pool_ids, pool_logits, budget=searched,
                                           children=children, expansions=expansions, max_depth=depth,
                                           prefix_len=prefix_len, root_children=root_children,
                                           interpret=interpret())
    else:
        state = WeaverState(cache, jnp.zeros((b, searched + 1, searched + 1), bool))
        score = adapter_children(adapter, tables, pool_ids, pool_logits, prefix_len)
        tree, _ = batched_best_first(root, score, state, budget=searched, children=children,
                                     expansions=expansions, max_depth=depth, root_children=root_children)
    return extend_deepest(tree, marginal_logits, marginal_tail) if marginal_tail else tree
