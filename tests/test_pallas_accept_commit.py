"""Acceptance + commit: the Pallas walk and in-place K/V move (interpret mode on a CPU, compiled on a GPU) equal the
plain-JAX walk and `commit_kv` on fresh random trees (the walk's outputs poisoned, so unwritten
elements fail), touch no slot outside the accepted rows, and lower for CUDA (Triton) at the shapes
the library uses."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weaver_jax import KVCache, Sampling
from weaver_jax._sampling import select
from weaver_jax._speculative import (
    accept,
    accept_and_move,
    depth_choices,
    depth_noise,
    node_choices,
    node_steps,
    walk_choices,
)
from weaver_jax._tree import Tree
from weaver_jax.pallas_kernels import interpret, kernel_scope
from weaver_jax.pallas_kernels.accept_commit import accept_commit, accept_commit_reference

from .cuda import lower_for_cuda


def random_tree(rng, batch, nodes, max_depth, padding, alphabet):
    """Random trees (parents before children, depth <= max_depth), tokens from a small alphabet so
    walks go deep and siblings can share a token; the last `padding` nodes are invalid."""
    parent, depth = np.full((batch, nodes), -1), np.zeros((batch, nodes), int)
    for r in range(batch):
        for i in range(1, nodes):
            candidates = [j for j in range(i) if depth[r, j] < max_depth]
            parent[r, i] = rng.choice(candidates)
            depth[r, i] = depth[r, parent[r, i]] + 1
    valid = np.broadcast_to(np.arange(nodes) < nodes - padding, (batch, nodes))
    return Tree(jnp.asarray(rng.integers(0, alphabet, (batch, nodes)), jnp.int32), jnp.asarray(parent, jnp.int32),
                jnp.asarray(depth, jnp.int32), jnp.asarray(valid))


def follow_children(rng, tree, alphabet):
    """Per-node target choices that mostly name a valid child's token (long paths), else anything."""
    tokens, parent, valid = (np.asarray(x) for x in (tree.tokens, tree.parent, tree.valid))
    choice = rng.integers(0, alphabet, tokens.shape)
    for r, i in np.ndindex(*tokens.shape):
        children = np.flatnonzero((parent[r] == i) & valid[r])
        if len(children) and (i == 0 or rng.random() < 0.8):  # the root always: every walk moves
            choice[r, i] = tokens[r, rng.choice(children)]
    return jnp.asarray(choice, jnp.int32)


CASES = [  # batch, nodes, max depth, padding, layers, kv heads, head dim, cache slots, dtype, layers in flight
    (1, 1, 3, 0, 2, 1, 16, 8, jnp.float32, 1),
    (3, 9, 4, 2, 2, 2, 16, 40, jnp.float32, 3),
    (2, 65, 15, 5, 3, 3, 32, 120, jnp.bfloat16, 4),
    (2, 256, 15, 30, 1, 2, 16, 300, jnp.float32, 1),
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case):
    b, n, depth, padding, layers, kv, d, s, dtype, in_flight = case
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, b, n, depth, padding, alphabet=2)
    choice = follow_children(rng, tree, alphabet=3)
    lengths = jnp.asarray(rng.integers(0, s - max(n, depth + 1) + 1, b), jnp.int32)  # the tree's slots fit
    layer = lambda: jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)  # noqa: E731
    cache = KVCache(tuple(layer() for _ in range(layers)), tuple(layer() for _ in range(layers)), lengths)
    before = jax.tree.map(lambda x: np.array(x, copy=True), cache)
    # jitted (as accept_commit is): one compile instead of one per eager op
    ref_acc, ref_cache = jax.jit(accept_commit_reference, static_argnames="max_depth")(tree, choice, cache,
                                                                                        max_depth=depth)
    acc, out = accept_commit(tree, choice, jax.tree.map(lambda x: jnp.array(x, copy=True), cache), max_depth=depth,
                             layers_in_flight=in_flight, interpret=interpret(), poison=True)
    msg = f"seed {seed}"
    for got, want in zip(acc, ref_acc, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=msg)
    assert (np.asarray(acc.length) > 1).any() or n == 1, msg  # the test exercises real moves
    np.testing.assert_array_equal(out.lengths, lengths)
    for got, want, old in zip(out.k + out.v, ref_cache.k + ref_cache.v, before.k + before.v, strict=True):
        for i in range(b):
            start, stop = int(lengths[i]), int(lengths[i] + acc.length[i])
            np.testing.assert_array_equal(got[i, :stop], want[i, :stop], err_msg=msg)  # committed rows
            np.testing.assert_array_equal(got[i, stop:], old[i, stop:], err_msg=msg)  # nothing else written
            assert start <= stop


def stepwise_walk(tree, choose, max_depth):
    """The acceptance walk one step at a time in Python: choose(b, node) -> the target's token there;
    move to the lowest-index valid child carrying it, else it is the bonus."""
    tokens, parent, valid = (np.asarray(x) for x in (tree.tokens, tree.parent, tree.valid))
    paths, lengths, bonuses = np.zeros((len(tokens), max_depth + 1), int), [], []
    for b in range(len(tokens)):
        path = [0]
        while True:
            y = choose(b, path[-1])
            children = np.flatnonzero(valid[b] & (parent[b] == path[-1]) & (tokens[b] == y))
            if not len(children):
                break
            path.append(children[0])
        paths[b, : len(path)] = path
        lengths.append(len(path))
        bonuses.append(y)
    return paths, np.array(lengths), np.array(bonuses)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0), Sampling(0.7, 5, 0.9)])
def test_walk_equals_a_stepwise_walk(sampling):
    """The walk without a depth loop (`walk_choices`, `accept`) takes the path a step-by-step walk
    takes, drawing at each node it visits with the key of the generated token it is for (first step
    + depth, as `ar` keys it); on fresh random trees whose siblings share tokens and with invalid nodes.
    The per-depth noise of a round (`depth_choices`) draws what per-node draws do."""
    rng = np.random.default_rng()
    b, n, depth, vocab = 4, 33, 6, 3
    rows = jnp.arange(b)
    for _ in range(10):  # fresh inputs until some walk moves past the root (a sampled root misses ~1 in 3)
        tree = random_tree(rng, b, n, depth, 3, alphabet=vocab)
        logits = jnp.asarray(rng.standard_normal((b, n, vocab)) * 2, jnp.float32)
        keys = jax.vmap(jax.random.key)(jnp.asarray(rng.integers(0, 2**31, b)))
        first = jnp.asarray(rng.integers(0, 50, b), jnp.int32)

        def draw(row, node, tree=tree, logits=logits, keys=keys, first=first):  # select() as the walk calls it
            return int(select(logits[rows, node], keys, first + tree.depth[:, node], sampling)[row])

        want = stepwise_walk(tree, draw, depth)
        if max(want[1]) > 1:
            break
    assert max(want[1]) > 1  # some walk moves
    choice = node_choices(logits, keys, node_steps(tree, first), sampling)
    # generate's rounds draw the noise once per depth and read it per node: the same draws
    noise = None if sampling.greedy else depth_noise(keys, first, depth + 1, vocab)
    np.testing.assert_array_equal(depth_choices(tree, logits, noise, sampling), choice)
    for got in (accept(tree, logits, keys, first, sampling, depth), walk_choices(tree, choice, depth),
                walk_choices(tree, choice, depth, tree.ancestors())):
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kernels", [(), ("accept_commit",)])
def test_accept_and_move_with_known_choices(kernels):
    """Choices handed in (as a fused LM head would) give the same acceptance and cache as logits."""
    rng = np.random.default_rng()
    b, n, depth, vocab, s = 3, 17, 5, 3, 40
    tree = random_tree(rng, b, n, depth, 2, alphabet=vocab)
    logits = jnp.asarray(rng.standard_normal((b, n, vocab)) * 2, jnp.float32)
    keys, first = jax.vmap(jax.random.key)(jnp.arange(b)), jnp.zeros((b,), jnp.int32)
    layer = lambda: jnp.asarray(rng.standard_normal((b, s, 2, 16)), jnp.float32)  # noqa: E731
    cache = KVCache((layer(),), (layer(),), jnp.asarray(rng.integers(0, s - n + 1, b), jnp.int32))
    fresh = lambda: jax.tree.map(lambda x: jnp.array(x, copy=True), cache)  # noqa: E731
    with kernel_scope(kernels):
        want = accept_and_move(tree, logits, fresh(), keys, first, Sampling(), depth)
        got = accept_and_move(tree, None, fresh(), None, None, Sampling(), depth,
                              choice=node_choices(logits, keys, node_steps(tree, first), Sampling()))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(x, y)


LIBRARY_SHAPES = [  # Qwen3-8B (36 layers, 8 K/V heads, dim 128) at budget 64 / 256, B 1 / 8; SmolLM2 (30, 3, 64)
    (8, 65, 15, 36, 8, 128, 17408, jnp.bfloat16), (1, 257, 15, 36, 8, 128, 2048, jnp.bfloat16),
    (1, 65, 15, 30, 3, 64, 1024, jnp.bfloat16), (32, 16, 15, 30, 3, 64, 512, jnp.float32),
]


@pytest.mark.parametrize("shape", LIBRARY_SHAPES)
@pytest.mark.parametrize("launch", [dict(), dict(layers_in_flight=1, num_warps=1)])
def test_lowers_for_cuda(shape, launch):
    b, n, depth, layers, kv, d, s, dtype = shape
    ids = jax.ShapeDtypeStruct((b, n), jnp.int32)
    tree = Tree(ids, ids, ids, jax.ShapeDtypeStruct((b, n), jnp.bool_))
    layer = jax.ShapeDtypeStruct((b, s, kv, d), dtype)
    cache = KVCache((layer,) * layers, (layer,) * layers, jax.ShapeDtypeStruct((b,), jnp.int32))
    assert lower_for_cuda(accept_commit, tree, ids, cache, max_depth=depth, **launch).count("triton") >= 2
