"""Adapter attention: the Pallas kernel gathering each node's visible slots (interpret mode on a CPU, compiled on a GPU)
equals the masked softmax over all slots on fresh random inputs, with the output poisoned so
unwritten elements fail; `visible_slots` lists exactly the mask's slots; and the kernel lowers for
CUDA (Triton) at the shapes the library uses."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weaver_jax.pallas_kernels import interpret
from weaver_jax.pallas_kernels.adapter_attention import adapter_attention, adapter_attention_reference, visible_slots

from .cuda import lower_for_cuda


def random_own(rng, batch, width, nodes, max_depth):
    """Each of `width` random nodes of a random tree (depth <= max_depth): its ancestors and itself."""
    own = np.zeros((batch, width, nodes), bool)
    for r in range(batch):
        parent, depth = [-1], [0]
        for i in range(1, nodes):
            p = int(rng.choice([j for j in range(i) if depth[j] < max_depth]))
            parent.append(p)
            depth.append(depth[p] + 1)
        for j, node in enumerate(rng.integers(0, nodes, width)):
            while node >= 0:
                own[r, j, node] = True
                node = parent[node]
    return jnp.asarray(own)


CASES = [  # batch, nodes being expanded, tree nodes, prefix, max depth, heads, head dim, dtype
    (1, 1, 1, 1, 3, 1, 16, jnp.float32),
    (2, 4, 65, 16, 15, 3, 64, jnp.float32),
    (3, 5, 20, 6, 5, 8, 32, jnp.bfloat16),
    (1, 16, 257, 16, 15, 2, 16, jnp.float32),
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case):
    b, w, n, prefix, depth, h, d, dtype = case
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    s = prefix + n + 3  # spare slots past the tree stay invisible
    q = jnp.asarray(rng.standard_normal((b, w, h, d)), dtype)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((b, s, h, d)), dtype) for _ in range(2))
    own = random_own(rng, b, w, n, depth)
    slots = visible_slots(own, prefix, depth)
    mask = np.concatenate([np.ones((b, w, prefix), bool), np.asarray(own), np.zeros((b, w, 3), bool)], axis=2)
    listed = np.zeros_like(mask)
    for r, j in np.ndindex(b, w):
        listed[r, j, [x for x in np.asarray(slots[r, j]) if x >= 0]] = True
    np.testing.assert_array_equal(listed, mask, err_msg=f"seed {seed}")
    out = adapter_attention(q, k_cache, v_cache, slots, interpret=interpret(), poison=True)
    ref = adapter_attention_reference(q, k_cache, v_cache, slots)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol, err_msg=f"seed {seed}")


LIBRARY_SHAPES = [  # the shipped SmolLM2 adapter (3 heads x 64) at budget 64; a Qwen3-8B-sized one (8 x 128) at 256
    (1, 4, 65, 16, 15, 3, 64, 96, jnp.bfloat16), (8, 16, 257, 16, 15, 8, 128, 288, jnp.bfloat16),
    (32, 1, 17, 16, 15, 3, 64, 48, jnp.float32),
]


@pytest.mark.parametrize("shape", LIBRARY_SHAPES)
def test_lowers_for_cuda(shape):
    b, w, n, prefix, depth, h, d, s, dtype = shape
    length = visible_slots(jnp.zeros((b, w, n), bool), prefix, depth).shape[2]
    args = [jax.ShapeDtypeStruct((b, w, h, d), dtype), jax.ShapeDtypeStruct((b, s, h, d), dtype),
            jax.ShapeDtypeStruct((b, s, h, d), dtype), jax.ShapeDtypeStruct((b, w, length), jnp.int32)]
    lower_for_cuda(adapter_attention, *args)
