"""Test drafters that know the answer, so long paths get accepted and committed."""

import jax
import jax.numpy as jnp
from flax import nnx

from weaver_jax._drafter import random_drafter_config
from weaver_jax._model import KVCache


class OracleDrafter(nnx.Module):
    """Proposes the target's own greedy continuation (run from the committed target cache), as
    confident logits; with `corrupt=True` one position per round (chosen by the context length)
    is replaced by another token, so accepted lengths vary and rejections happen mid-path; with
    `logits=True` its marginals are the target's own logits along that continuation (the first one the
    target's exact next-token distribution, whatever it samples)."""

    def __init__(self, target_config, block_size: int = 6, corrupt: bool = False, logits: bool = False):
        self.config = random_drafter_config(target_config, num_layers=1, block_size=block_size)
        self.logits = logits
        # a traced flag, not a static attribute: oracle and corrupted oracle share one compiled generate
        self.corrupt = nnx.Variable(jnp.asarray(corrupt))

    def init_cache(self, batch: int, size: int) -> KVCache:
        return KVCache(k=(), v=(), lengths=jnp.zeros((batch,), jnp.int32))

    def commit(self, cache, target_hidden, positions, num_new):
        return KVCache(k=(), v=(), lengths=cache.lengths + num_new.astype(jnp.int32))

    def propose(self, target, target_cache, root, cache, depth=None):
        positions, vocab = self.config.block_size - 1, self.config.vocab_size

        def step(carry, i):  # a scan, not an unrolled loop: one target step in the program to compile
            token, c = carry
            out = target(token[:, None], (target_cache.lengths + i)[:, None], c)
            c = target.commit(out.cache, out.pending, jnp.zeros_like(token)[:, None], jnp.ones_like(token))
            token = jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32)
            return (token, c), (token, out.logits[:, 0])

        tokens, logits = jax.lax.scan(step, (root, target_cache), jnp.arange(positions))[1]
        tokens = tokens.T  # [B, K]
        where = (target_cache.lengths % (positions + 2))[:, None] == jnp.arange(positions)[None, :]
        tokens = jnp.where(where & self.corrupt[...], (tokens + 1) % vocab, tokens)
        noise = jax.random.normal(jax.random.key(0), (positions, vocab))
        states = jnp.take(target.embed[...], tokens, axis=0)  # stand-in drafter states for the adapter
        if self.logits:
            return jnp.moveaxis(logits, 0, 1)[:, :depth], states
        return (8.0 * jax.nn.one_hot(tokens, vocab) + noise[None])[:, :depth], states
