"""Tree builders: shape invariants, and DDTree equals brute-force enumeration of the top prefixes."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import weaver_jax as wj
from weaver_jax._tree import Tree, batched_best_first, chain, ddtree, marginal_children


def check_valid_tree(tree: Tree, max_depth: int):
    tokens, parent, depth, valid = (np.asarray(x) for x in tree)
    for b in range(tokens.shape[0]):
        assert valid[b, 0] and parent[b, 0] == -1 and depth[b, 0] == 0
        for i in range(1, tokens.shape[1]):
            if not valid[b, i]:
                continue
            p = parent[b, i]
            assert 0 <= p < i and valid[b, p], "parents precede children and are valid"
            assert depth[b, i] == depth[b, p] + 1 <= max_depth
        # no two siblings carry the same token
        pairs = [(parent[b, i], tokens[b, i]) for i in range(1, tokens.shape[1]) if valid[b, i]]
        assert len(pairs) == len(set(pairs))


def paths(tree: Tree, b: int) -> set[tuple[int, ...]]:
    tokens, parent, _, valid = (np.asarray(x) for x in tree)
    out = set()
    for i in range(1, tokens.shape[1]):
        if valid[b, i]:
            path, j = [], i
            while j > 0:
                path.append(int(tokens[b, j]))
                j = parent[b, j]
            out.add(tuple(reversed(path)))
    return out


def brute_force_top(logits: np.ndarray, budget: int, root_children: int | None = None,
                    children: int | None = None) -> set[tuple[int, ...]]:
    """The `budget` best prefixes; with widths, only prefixes whose first token is among marginal 0's
    top `root_children` and every later one among its marginal's top `children`."""
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), -1), np.float64)
    k, v = logp.shape
    rank = np.argsort(np.argsort(-logp, axis=1), axis=1)
    widths = [root_children or v] + [children or v] * (k - 1)
    scored = []
    for d in range(1, k + 1):
        for prefix in itertools.product(range(v), repeat=d):
            if all(rank[t, x] < widths[t] for t, x in enumerate(prefix)):
                scored.append((sum(logp[t, x] for t, x in enumerate(prefix)), prefix))
    scored.sort(key=lambda s: -s[0])
    return {p for _, p in scored[:budget]}


# jitted: one compile per example's shapes instead of one per eager op
_ddtree = jax.jit(ddtree, static_argnums=2)


@functools.partial(jax.jit, static_argnames=("pool", "budget", "children", "expansions", "max_depth", "root_children"))
def _marginal_best_first(logits, *, pool, budget, children, expansions, max_depth, root_children=None):
    """`batched_best_first` over the marginals' top-`pool` children of roots [1, 2] -> the tree."""
    return batched_best_first(jnp.array([1, 2]), marginal_children(logits, pool), None, budget=budget,
                              children=children, expansions=expansions, max_depth=max_depth,
                              root_children=root_children)[0]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 5), depth=st.integers(1, 3), budget=st.integers(1, 40))
def test_ddtree_is_the_exact_top_budget(seed, vocab, depth, budget):
    logits = np.random.default_rng(seed).standard_normal((2, depth, vocab)) * 2
    tree = _ddtree(jnp.array([7, 9]), jnp.asarray(logits), budget)
    check_valid_tree(tree, depth)
    total = sum(vocab**d for d in range(1, depth + 1))
    assert np.asarray(tree.valid).sum(1).tolist() == [1 + min(budget, total)] * 2
    for b in range(2):
        assert paths(tree, b) == brute_force_top(logits[b], budget)
    assert np.asarray(tree.tokens)[:, 0].tolist() == [7, 9]


def test_ddtree_full_budget_on_a_large_vocabulary():
    logits = jax.random.normal(jax.random.key(0), (3, 7, 500))
    tree = _ddtree(jnp.arange(3), logits, 64)
    check_valid_tree(tree, 7)
    assert np.asarray(tree.valid).sum(1).tolist() == [65, 65, 65]


def test_chain_is_the_argmax_path():
    logits = jax.random.normal(jax.random.key(1), (2, 5, 30))
    tree = chain(jnp.array([1, 2]), logits)
    check_valid_tree(tree, 5)
    assert np.array_equal(np.asarray(tree.tokens)[:, 1:], np.argmax(logits, -1))
    assert np.array_equal(np.asarray(tree.parent)[0], np.arange(-1, 5))


def test_extend_deepest_chains_the_argmax_below_the_first_deepest_node():
    """The tail hangs below the first node of the greatest depth, follows the marginals' argmax one
    level per node, and is padding past the drafter's depth."""
    from weaver_jax._tree import extend_deepest

    logits = jax.random.normal(jax.random.key(2), (2, 5, 30))
    tree = _marginal_best_first(logits, pool=3, budget=4, children=3, expansions=2, max_depth=5)
    out = jax.jit(extend_deepest, static_argnums=2)(tree, logits, 4)
    check_valid_tree(out, 5)
    assert all(np.array_equal(np.asarray(a)[:, :5], np.asarray(b)) for a, b in zip(out, tree, strict=True))
    depth, valid, argmax = np.asarray(tree.depth), np.asarray(tree.valid), np.argmax(logits, -1)
    for b in range(2):
        leaf = int(np.flatnonzero(depth[b] == depth[b][valid[b]].max())[0])
        d = depth[b, leaf] + np.arange(1, 5)
        assert np.asarray(out.parent)[b, 5:].tolist() == [leaf, 5, 6, 7]
        assert np.array_equal(np.asarray(out.depth)[b, 5:], d)
        assert np.array_equal(np.asarray(out.valid)[b, 5:], d <= 5)
        kept = d <= 5
        assert np.array_equal(np.asarray(out.tokens)[b, 5:][kept], argmax[b, d[kept] - 1])


def test_ancestor_matrix():
    parent = jnp.array([[-1, 0, 0, 1, 3, 2, 0]])
    valid = jnp.array([[True, True, True, True, True, True, False]])
    tree = Tree(jnp.zeros_like(parent), parent, jnp.zeros_like(parent), valid)
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 3, 4}, 5: {0, 2, 5}, 6: {6}}
    for anc in (tree.ancestors(), tree.ancestors(max_depth=3)):
        for i, seen in expected.items():
            assert set(np.flatnonzero(np.asarray(anc)[0, i])) == seen


@pytest.mark.parametrize("nodes,max_depth,padding", [(1, 0, 0), (2, 1, 0), (17, 4, 3), (65, 15, 5), (65, 64, 0)])
def test_ancestors_by_pointer_doubling_equal_parent_chasing(nodes, max_depth, padding):
    """On fresh random trees (chains included: max_depth = N - 1), each row is the node and the
    nodes met by following parents to the root; invalid nodes see only themselves."""
    from .test_pallas_accept_commit import random_tree

    rng = np.random.default_rng()
    tree = random_tree(rng, 3, nodes, max_depth, padding, alphabet=4)
    if max_depth == nodes - 1:  # one chain of full depth
        tree = tree._replace(parent=jnp.broadcast_to(jnp.arange(-1, nodes - 1), (3, nodes)),
                             depth=jnp.broadcast_to(jnp.arange(nodes), (3, nodes)))
    parent, valid = np.asarray(tree.parent), np.asarray(tree.valid)
    for anc in (tree.ancestors(max_depth), tree.ancestors()):
        anc = np.asarray(anc)
        for b, i in np.ndindex(3, nodes):
            want, j = {i}, i
            while valid[b, i] and parent[b, j] >= 0:
                j = parent[b, j]
                want.add(j)
            assert set(np.flatnonzero(anc[b, i])) == want, (b, i)


@pytest.mark.parametrize("budget", [0, -3])
def test_ddtree_rejects_a_budget_below_one(budget):
    from weaver_jax._speculative import tree_options

    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        tree_options("ddtree", {"budget": budget}, block_size=8, vocab_size=100)


def test_weaver_widens_the_root_by_default_only_when_sampling():
    """Sampled text often starts outside a node's top 8: the root offers budget // 2 first tokens
    (within children_per_node and the pool); greedy and explicit choices keep theirs."""
    from weaver_jax._speculative import tree_options

    def root(budget, sampled, **options):
        return tree_options("weaver", {"budget": budget, **options}, block_size=16, vocab_size=1000, pool_size=512,
                            sampled=sampled)["root_children"]

    assert [root(64, False), root(64, True), root(24, True), root(8, True), root(512, True)] == [8, 32, 12, 8, 64]
    assert root(64, True, root_children=5) == 5 and root(64, True, pool_size=20) == 20


def test_default_budget_fills_a_tile_on_large_targets_and_shrinks_with_the_batch(monkeypatch):
    """Below a billion parameters the launch-bound defaults (Weaver 24, DDTree 64) whatever the batch; above,
    budgets of 16 / 32 / 64 rows, B x (budget + 1) at most 128 (Weaver) or 64 (DDTree); an explicit budget
    wins, and the default reaches `generate`'s program (its static options) by the batch size it is given."""
    from weaver_jax import _generate, _speculative
    from weaver_jax._speculative import LARGE_TARGET_PARAMETERS, default_budget, tree_options

    small, large = LARGE_TARGET_PARAMETERS - 1, LARGE_TARGET_PARAMETERS
    assert [default_budget(m, b, small) for m in ("weaver", "ddtree") for b in (1, 8)] == [24, 24, 64, 64]
    assert [default_budget("weaver", b, large) for b in (1, 2, 3, 4, 5, 8, 64)] == [63, 63, 31, 31, 15, 15, 15]
    assert [default_budget("ddtree", b, large) for b in (1, 2, 3, 8)] == [31, 31, 15, 15]
    budget = lambda options, batch: tree_options("weaver", options, block_size=16, vocab_size=1000,  # noqa: E731
                                                 pool_size=64, batch=batch, target_parameters=large)["budget"]
    assert (budget({}, 8), budget({"budget": 40}, 8)) == (15, 40)
    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        budget({"budget": 0}, 1)

    bundle = wj.testing.random_bundle(seed=0)  # a small target, counted as a large one
    monkeypatch.setattr(_speculative, "LARGE_TARGET_PARAMETERS", 1)
    for batch, want in [(1, 63), (8, 15)]:
        static = _generate._prepare(bundle, [[1, 2, 3]] * batch, "weaver", 4, 0.0, 0, 1.0, 0, [], {})[1]
        assert dict(static["options"])["budget"] == want


def test_batched_best_first_with_one_expansion_per_call_is_ddtree():
    """w = 1 and enough children per node is strict best-first: DDTree's exact top-budget set."""
    rng = np.random.default_rng(3)
    for vocab, depth, budget in [(4, 3, 20), (6, 4, 33), (50, 6, 64)]:
        logits = jnp.asarray(rng.standard_normal((2, depth, vocab)) * 2)
        c = min(budget, vocab)
        tree = _marginal_best_first(logits, pool=c, budget=budget, children=c, expansions=1, max_depth=depth)
        check_valid_tree(tree, depth)
        ref = _ddtree(jnp.array([1, 2]), logits, budget)
        for b in range(2):
            assert paths(tree, b) == paths(ref, b)


def test_batched_best_first_with_a_wider_root_is_its_exact_top():
    """One expansion per call with `root_children` first tokens and `children` below: exactly the
    best `budget` prefixes among those the widths allow (the root's slots before every node's)."""
    rng = np.random.default_rng(5)
    for vocab, depth, budget, root, c in [(6, 3, 20, 5, 2), (5, 3, 30, 1, 4), (7, 2, 12, 7, 1)]:
        logits = jnp.asarray(rng.standard_normal((2, depth, vocab)) * 2)
        tree = _marginal_best_first(logits, pool=max(root, c), budget=budget, children=c, expansions=1,
                                    max_depth=depth, root_children=root)
        check_valid_tree(tree, depth)
        for b in range(2):
            assert paths(tree, b) == brute_force_top(np.asarray(logits[b]), budget, root, c)
    with pytest.raises(ValueError, match="the scorer ranked the top 2 children, 3 were asked for"):
        batched_best_first(jnp.array([1, 2]), marginal_children(logits, 2), None, budget=4, children=2, expansions=1,
                           max_depth=2, root_children=3)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 300), children=st.integers(1, 8),
       root=st.one_of(st.none(), st.integers(1, 12)), depth=st.integers(1, 7))
def test_batched_best_first_makes_valid_full_trees(seed, budget, children, root, depth):
    """Any budget, children per node (and at the root) and default expansions: a valid tree with
    exactly `budget` nodes past the root whenever that many prefixes exist, in the static
    `search_calls` scorer calls (about budget / w)."""
    from weaver_jax._tree import search_calls

    vocab = 40
    logits = jnp.asarray(np.random.default_rng(seed).standard_normal((3, depth, vocab)))
    w = -(-budget // 16)
    inner = marginal_children(logits, max(children, root or 0))

    def counting(calls, tree, nodes, width):  # the state counts scorer calls
        tokens, logp, _ = inner(None, tree, nodes, width)
        return tokens, logp, calls + 1

    # one program per example, not a compilation per primitive: XLA's CPU compiler crashed (a segfault, twice in
    # full suites) compiling this search's loop eagerly
    search = jax.jit(lambda roots: batched_best_first(roots, counting, jnp.int32(0), budget=budget,
                                                      children=children, expansions=w, max_depth=depth,
                                                      root_children=root))
    tree, calls = search(jnp.arange(3))
    check_valid_tree(tree, depth)
    possible = sum((root or children) * children ** (d - 1) for d in range(1, depth + 1))
    assert np.asarray(tree.valid).sum(1).tolist() == [1 + min(budget, possible)] * 3
    assert int(calls) == 1 + search_calls(budget, children, w, depth, root)  # the root's call, then a fixed count


def test_search_calls_fill_the_tree_whichever_entries_are_taken():
    """`search_calls` is enough when every call takes the frontier's deepest entries (which publish
    the fewest children) and when it takes the shallowest: a count of entries per depth."""
    from weaver_jax._tree import search_calls

    def filled(budget, children, w, depth, deepest, root):
        frontier, got = {1: root}, 0
        for _ in range(search_calls(budget, children, w, depth, root)):
            new = {}
            for _ in range(min(w, sum(frontier.values()), budget - got)):
                d = (max if deepest else min)(frontier)
                frontier[d] -= 1
                frontier = {k: v for k, v in frontier.items() if v}
                got += 1
                if d < depth:
                    new[d + 1] = new.get(d + 1, 0) + children
            for k, v in new.items():
                frontier[k] = frontier.get(k, 0) + v
        return got

    for children, w, depth, wider in itertools.product((1, 2, 3, 8), (1, 3, 8, 16), (1, 2, 3, 15), (0, 5)):
        root = children + wider
        possible = sum(root * children ** (d - 1) for d in range(1, depth + 1))
        for budget in (1, 5, 16, 64, 130):
            for deepest in (True, False):
                assert filled(budget, children, w, depth, deepest, root) == min(budget, possible), (
                    budget, children, w, depth, deepest, root)
    assert [search_calls(b, 8, -(-b // 16), 15) for b in (16, 64, 256)] == [16, 16, 17]


@pytest.mark.parametrize("v,k", [(49152, 512), (151936, 512), (49152, 64), (96, 8), (1000, 7), (64, 60), (37, 5)])
def test_chunked_top_k_equals_top_k(v, k):
    """The two-stage selection returns the values of `jax.lax.top_k` and distinct ids holding them, on
    fresh random rows and on rows full of ties, at shapes with and without chunking; the same ids
    wherever a value is not tied."""
    from weaver_jax._tree import chunked_top_k

    x = jax.random.normal(jax.random.key(np.random.default_rng().integers(1 << 30)), (2, 3, v))
    for rows in (x, jnp.round(x * 2) / 2):  # the second: many equal values
        want_values, want_ids = jax.lax.top_k(rows, k)
        values, ids = jax.jit(chunked_top_k, static_argnums=1)(rows, k)
        np.testing.assert_array_equal(values, want_values)
        np.testing.assert_array_equal(jnp.take_along_axis(rows, ids, -1), values)
        assert all(len(set(row)) == k for row in np.asarray(ids).reshape(-1, k).tolist())
        ordered, top = np.sort(np.asarray(rows), -1).reshape(6, v), np.asarray(values).reshape(6, k)
        unique = np.stack([np.searchsorted(o, t, "right") - np.searchsorted(o, t, "left") == 1
                           for o, t in zip(ordered, top, strict=True)])
        np.testing.assert_array_equal(np.asarray(ids).reshape(6, k)[unique], np.asarray(want_ids).reshape(6, k)[unique])
