"""Token selection from target logits: greedy, or sampling with temperature / top-k / top-p.

Randomness is keyed per sequence: each sequence carries its own key and the draw of its t-th
generated token uses `fold_in(key, t)` (in every method: a speculative round draws at each tree node
with the key of the token that node's draw is for), so a sequence's samples do not depend on the
rest of the batch, nor on the method.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Static sampling configuration (`ar_generate` / `spec_generate`'s `sampling`): `temperature == 0` means
    greedy (argmax); `top_k` 0 and `top_p` 1 filter nothing. `generate` builds it from its arguments.

        weaver_jax.Sampling(temperature=0.7, top_k=50, top_p=0.9)
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _top_p_keep(sorted_logits: jax.Array, top_p: float) -> jax.Array:
    """For logits sorted descending `[..., K]`: keep the smallest prefix whose mass reaches top_p."""
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return mass_before < top_p


def filtered_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Temperature-scaled logits `[..., V]` with everything outside top-k / top-p set to -inf (a token
    tied with the k-th largest stays in, as in Hugging Face's top-k)."""
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        ordered = jax.lax.top_k(logits, sampling.top_k)[0]
    elif sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1, descending=True)
    else:
        return logits
    if sampling.top_p < 1:
        ordered = jnp.where(_top_p_keep(ordered, sampling.top_p), ordered, jnp.inf)
    threshold = jnp.min(ordered, axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def draw_noise(keys: jax.Array, step: jax.Array, size: int) -> jax.Array:
    """The Gumbel noise `[B, size]` of the draw keyed by `fold_in(keys[i], step[i])`: `select` samples
    the argmax of the filtered logits plus this noise (the Gumbel-max trick, as `jax.random.categorical`),
    and a speculative round perturbs its draft scores with the same noise, so that its proposals are
    coupled to the draws that verify them (`_speculative.coupled_drafts`)."""
    step_keys = jax.vmap(jax.random.fold_in)(keys, jnp.broadcast_to(step, keys.shape))
    return jax.vmap(lambda key: jax.random.gumbel(key, (size,), jnp.float32))(step_keys)


def choose(logits: jax.Array, noise: jax.Array | None, sampling: Sampling) -> jax.Array:
    """logits `[..., V]` and the draws' Gumbel noise (`draw_noise`, same shape; None when greedy) ->
    tokens `[...]` int32: the argmax, or the sample argmax(filtered logits + noise)."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.argmax(filtered_logits(logits, sampling) + noise, axis=-1).astype(jnp.int32)


def select(logits: jax.Array, keys: jax.Array, step: jax.Array, sampling: Sampling) -> jax.Array:
    """logits `[B, V]`, keys `[B]` (one per sequence), step scalar or `[B]` -> tokens `[B]` int32.
    The draw of sequence i uses `fold_in(keys[i], step[i])` (`draw_noise`)."""
    return choose(logits, None if sampling.greedy else draw_noise(keys, step, logits.shape[-1]), sampling)
