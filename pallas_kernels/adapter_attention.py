"""The Weaver adapter's attention: each node being expanded attends to the adapter's prefix K/V
(the root's target state and the drafter states) and to its ancestors' K/V (and its own), listed
as cache slots, instead of masking every slot of the tree.

A node sees at most prefix + max_depth + 1 keys (32 for a 16-deep drafter) however large the tree,
so one Pallas Triton program per (batch, node, head) gathers exactly those rows, takes the softmax
in float32 and writes the head's output. `adapter_attention_reference` is the masked softmax over
all slots that the adapter computes in XLA.

Shapes: q `[B, W, H, D]` (the W nodes of one expansion, after RoPE), k_cache / v_cache
`[B, S, H, D]` (the adapter has as many K/V heads as query heads; the W nodes' K/V already written),
slots `[B, W, L]` int32: the visible slots of each node, -1 for none (`visible_slots`). -> `[B, W, H, D]`
float32. D a power of two >= 16.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from weaver_jax._model import gqa_attention
from weaver_jax.pallas_kernels import MASKED_SCORE
from weaver_jax.pallas_kernels._call import pallas_call, pow2_at_least


def visible_slots(own: jax.Array, prefix_len: int, max_depth: int) -> jax.Array:
    """own `[B, W, N]` (a node's ancestors and itself among the tree's N nodes, whose K/V sit at
    slot prefix_len + node) -> slots `[B, W, L]`: the prefix's slots, then those nodes' slots
    (deepest first), -1 padded to L = a power of two >= prefix_len + max_depth + 1."""
    b, w, n = own.shape
    path = min(n, max_depth + 1)
    nodes = jax.lax.top_k(jnp.where(own, jnp.arange(n), -1), path)[0]  # [B, W, path], -1 where fewer
    width = pow2_at_least(prefix_len + path)
    return jnp.concatenate([jnp.broadcast_to(jnp.arange(prefix_len, dtype=jnp.int32), (b, w, prefix_len)),
                            jnp.where(nodes >= 0, prefix_len + nodes, -1).astype(jnp.int32),
                            jnp.full((b, w, width - prefix_len - path), -1, jnp.int32)], axis=2)


def adapter_attention_reference(q, k_cache, v_cache, slots):
    """The same attention as a masked softmax over all S slots."""
    b, w, h, d = q.shape
    mask = jnp.any(slots[..., None] == jnp.arange(k_cache.shape[1]), axis=2)  # [B, W, S]
    return gqa_attention(q.reshape(b, w, h, 1, d), k_cache, v_cache, mask).reshape(b, w, h, d)


def _kernel(slots_ref, q_ref, k_ref, v_ref, o_ref, *, scale: float):
    b, h = pl.program_id(0), pl.program_id(2)
    slots = slots_ref[...]  # [L]
    visible = slots >= 0
    d = q_ref.shape[-1]
    rows = (jnp.where(visible, slots, 0)[:, None], jnp.arange(d)[None, :])
    mask = jnp.broadcast_to(visible[:, None], (slots.shape[0], d))
    keys = plgpu.load(k_ref.at[b, rows[0], h, rows[1]], mask=mask, other=0).astype(jnp.float32)  # [L, D]
    scores = jnp.sum(keys * q_ref[...].astype(jnp.float32)[None, :], axis=1) * scale
    scores = jnp.where(visible, scores, MASKED_SCORE)
    p = jnp.where(visible, jnp.exp(scores - jnp.max(scores)), 0.0)
    values = plgpu.load(v_ref.at[b, rows[0], h, rows[1]], mask=mask, other=0).astype(jnp.float32)
    o_ref[...] = jnp.sum(p[:, None] * values, axis=0) / jnp.sum(p)


@functools.partial(jax.jit, static_argnames=("interpret", "poison"))
def adapter_attention(q, k_cache, v_cache, slots, *, interpret: bool = False, poison: bool = False):
    """The adapter's node attention over gathered slots (see the module docstring). poison (tests):
    the output starts as NaN, so an element no program writes cannot pass."""
    b, w, h, d = q.shape
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    if k_cache.shape[2] != h:
        raise ValueError(f"the adapter has as many K/V heads as query heads, got {k_cache.shape[2]} and {h}")
    length = slots.shape[2]
    if length & (length - 1):
        raise ValueError(f"slots per node must be a power of two, got {length} (use visible_slots)")
    head = pl.BlockSpec((None, None, None, d), lambda i, j, k: (i, j, k, 0))
    in_specs = [pl.BlockSpec((None, None, length), lambda i, j, k: (i, j, 0)), head, pl.BlockSpec(), pl.BlockSpec()]
    return pallas_call(
        functools.partial(_kernel, scale=1 / math.sqrt(d)), [slots.astype(jnp.int32), q, k_cache, v_cache],
        grid=(b, w, h), in_specs=in_specs, out_specs=head, out_shape=jax.ShapeDtypeStruct((b, w, h, d), jnp.float32),
        name="adapter_attention", num_warps=1, num_stages=1, interpret=interpret, poison=poison)
