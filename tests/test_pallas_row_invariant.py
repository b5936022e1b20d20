"""Exact mode's row-invariant kernels (interpret mode on a CPU, compiled on a GPU): the product and the attention equal
their XLA references on fresh random inputs (outputs poisoned, so unwritten elements fail), and a
row's value is bitwise the same whatever rows come with it: the product one row at a time or
shuffled, a tree node's attention against the same node decoded alone after its committed path.
Both kernels lower for CUDA (Triton) at the library's shapes."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weaver_jax._model import position_path
from weaver_jax.pallas_kernels import interpret, row_invariant
from weaver_jax.pallas_kernels.row_invariant import attention, attention_reference, matmul, matmul_reference

from .cuda import lower_for_cuda
from .test_model import ancestor_matrix, random_tree


def fresh_rng():
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, np.random.default_rng(seed)


@pytest.mark.parametrize("m,k,n,transpose_w,dtype,tiling", [
    (37, 96, 80, False, jnp.bfloat16, row_invariant.TILING),  # K and N masked, M not a multiple of 16
    (1, 64, 64, False, jnp.float32, row_invariant.TILING),
    (20, 128, 192, True, jnp.bfloat16, row_invariant.TILING),  # the tied LM head's layout
    (17, 512, 64, False, jnp.bfloat16, row_invariant.TILING),  # K in 4 pieces (few columns), their sums added in order
    (18, 512, 96, False, jnp.bfloat16, row_invariant.Tiling(block_n=32, block_k=128, stages=2, programs=8)),
])
def test_matmul_matches_reference_and_is_row_invariant(m, k, n, transpose_w, dtype, tiling):
    seed, rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)), dtype)
    product = functools.partial(matmul, transpose_w=transpose_w, tiling=tiling, interpret=interpret())
    out = product(x, w, poison=True)
    np.testing.assert_allclose(out, matmul_reference(x, w, transpose_w=transpose_w), rtol=1e-5, atol=1e-4,
                               err_msg=f"seed {seed}")
    for i in sorted({0, m // 2, m - 1}):  # alone: a decode step's single row
        np.testing.assert_array_equal(product(x[i:i + 1], w)[0], out[i], err_msg=f"seed {seed}, row {i}")
    order = rng.permutation(m)  # every row in another tile position
    np.testing.assert_array_equal(product(x[order], w), out[order], err_msg=f"seed {seed}")


def random_paths(rng, nodes: int):
    """A random tree (`test_model.random_tree`): each node's path, root first, and the ancestors-or-self
    table `[N, N]`."""
    parent = random_tree(rng, nodes)
    paths = []
    for i in range(nodes):
        path = [i]
        while parent[path[-1]] >= 0:
            path.append(int(parent[path[-1]]))
        paths.append(path[::-1])
    return paths, ancestor_matrix(parent)


@pytest.mark.parametrize("b,n,h,kv,d,prefix,dtype,split", [
    (2, 13, 4, 2, 16, (0, 70), jnp.bfloat16, 0),  # an empty prefix; positions across a 64-block boundary
    (1, 1, 3, 3, 32, (5,), jnp.float32, 0),  # one node
    (1, 24, 8, 2, 16, (100,), jnp.bfloat16, 0),
    (2, 13, 4, 2, 16, (0, 70), jnp.bfloat16, 64),  # pieces of 64 positions: 1-2 per token, the rest empty
    (2, 13, 4, 2, 16, (0, 70), jnp.bfloat16, 128),  # one piece (no merge), alone two (the merge's path)
])
def test_attention_matches_reference_and_is_row_invariant(b, n, h, kv, d, prefix, dtype, split):
    """Each token's value equals the reference's up to rounding and, bit for bit, its value decoded alone after
    its path, there from a cache with more slots (with `split`: more empty pieces to skip)."""
    seed, rng = fresh_rng()
    s = max(prefix) + n + 3
    q = jnp.asarray(rng.standard_normal((b, n, h, d)), dtype)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype) for _ in range(2))
    lengths = jnp.asarray(prefix, jnp.int32)
    paths, attend = zip(*(random_paths(rng, n) for _ in range(b)), strict=True)
    depth = np.array([[len(p) - 1 for p in tree] for tree in paths])
    attend = np.stack(attend)
    positions = lengths[:, None] + jnp.asarray(depth)
    path = position_path(positions, lengths, jnp.asarray(attend))
    out = attention(q, k_cache, v_cache, positions, lengths, path, split=split, interpret=interpret(), poison=True)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(out, attention_reference(q, k_cache, v_cache, positions, lengths, path), atol=tol,
                               rtol=tol, err_msg=f"seed {seed}")
    for r in range(b):  # the deepest node and one other, decoded alone after its path was committed
        for i in sorted({int(np.argmax(depth[r])), n - 1}):
            slots = int(lengths[r]) + np.array(paths[r][i])
            committed = [jnp.pad(c.at[r, int(lengths[r]):int(lengths[r]) + len(slots)].set(c[r, slots]),
                                 ((0, 0), (0, 130), (0, 0), (0, 0))) for c in (k_cache, v_cache)]
            alone = attention(q[r:r + 1, i:i + 1], committed[0][r:r + 1], committed[1][r:r + 1],
                              positions[r:r + 1, i:i + 1], jnp.asarray([int(positions[r, i])]),
                              jnp.zeros((1, 1, 1), jnp.int32), split=split, interpret=interpret())
            np.testing.assert_array_equal(alone[0, 0], out[r, i], err_msg=f"seed {seed}, sequence {r}, node {i}")


def test_merge_equals_one_softmax_over_the_pieces_and_skips_empty_ones():
    """The pieces' states merged equal the attention over all of them at once (float64), and empty pieces (sum 0)
    leave a token's bits as they were."""
    seed, rng = fresh_rng()
    pieces, tokens, d = 6, 5, 16
    scores, values = rng.standard_normal((pieces, tokens, 8)), rng.standard_normal((pieces, tokens, 8, d))
    seen = rng.random((pieces, tokens, 8)) < 0.7
    seen[0], seen[2], seen[4, :2] = True, False, False  # piece 0 holds the token's own key; some pieces empty
    m = np.where(seen.any(-1), np.where(seen, scores, -np.inf).max(-1), -1e30)
    p = np.exp(np.where(seen, scores - m[..., None], -np.inf))
    o, total = (p[..., None] * values).sum(2), p.sum(-1)
    merged = jax.jit(row_invariant.merge_pieces)(*(jnp.asarray(a, jnp.float32) for a in (o, m, total)))
    every = np.where(seen, np.exp(scores - scores.max()), 0)
    want = np.einsum("ptk,ptkd->td", every, values) / every.sum((0, 2))[:, None]
    np.testing.assert_allclose(merged, want, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
    fewer = [0, 1, 3, 4, 5]  # the same without piece 2, empty everywhere
    alone = jax.jit(row_invariant.merge_pieces)(*(jnp.asarray(a[fewer], jnp.float32) for a in (o, m, total)))
    np.testing.assert_array_equal(merged, alone, err_msg=f"seed {seed}")


MATMUL_SHAPES = [(1, 576, 960, False), (25, 1536, 576, False), (1, 576, 49152, True), (65, 4096, 12288, False),
                 (3, 5120, 48, False), (2, 96, 80, True)]  # the 27B's GDN gates (N masked); N and K masked


@pytest.mark.parametrize("m,k,n,transpose_w", MATMUL_SHAPES)  # SmolLM2's qkv, MLP-down and tied head; Qwen3-8B's qkv
def test_matmul_lowers_for_cuda(m, k, n, transpose_w):
    product = jax.jit(functools.partial(matmul, transpose_w=transpose_w))
    lower_for_cuda(product, jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                   jax.ShapeDtypeStruct((n, k) if transpose_w else (k, n), jnp.bfloat16))


# the last: 63 pieces of 128 positions (the merge unrolled in XLA)
@pytest.mark.parametrize("b,t,h,kv,d,s,split", [(1, 1, 9, 3, 64, 2048, 0), (1, 1, 9, 3, 64, 2048, 256),
                                                 (8, 25, 9, 3, 64, 512, 0), (1, 65, 32, 8, 128, 8000, 128)])
def test_attention_lowers_for_cuda(b, t, h, kv, d, s, split):
    lower_for_cuda(jax.jit(functools.partial(attention, split=split)), jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16),
                   *(jax.ShapeDtypeStruct((b, s, kv, d), jnp.bfloat16) for _ in range(2)),
                   jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
                   jax.ShapeDtypeStruct((b, t, t), jnp.int32))


def test_a_first_kernel_trace_leaves_jax_trace_context_as_it_was():
    """A kernel lowered inside a jitted function for the first time in a process does not change jax's trace
    context (a lazily imported module of Pallas adds a flag to it), so the function's second call does not trace
    and compile it again."""
    code = ("import jax, jax.numpy as jnp\n"
            "from weaver_jax.pallas_kernels import interpret\n"
            "from weaver_jax.pallas_kernels.row_invariant import matmul\n"
            "f = jax.jit(lambda x, w: matmul(x, w, interpret=interpret()))\n"
            "x, w = jnp.ones((2, 64)), jnp.ones((64, 64))\n"
            "f(x, w); f(x, w)\n"
            "assert f._cache_size() == 1, f._cache_size()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
