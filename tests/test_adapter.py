"""The Weaver adapter and its tree: the zero-residual tree is the marginal tree of the same
batched search, a path-dependent residual gives same-depth nodes different children, and a node
step's cost does not grow with the vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from weaver_jax._adapter import Adapter, WeaverState, adapter_children, random_adapter_config, weaver_tree
from weaver_jax._model import KVCache
from weaver_jax._tree import Tree, batched_best_first, marginal_children

from .conftest import make_pair
from .test_tree import check_valid_tree

DEPTH, BUDGET = 5, 40


def setup(seed=0, vocab=128, **adapter_options):
    cfg, _, target = make_pair("qwen3", seed=seed, vocab_size=vocab)
    adapter = Adapter(random_adapter_config(cfg, depth=DEPTH, **adapter_options), rngs=nnx.Rngs(seed))
    keys = jax.random.split(jax.random.key(seed), 3)
    inputs = dict(root=jnp.array([3, 4]), root_state=jax.random.normal(keys[0], (2, cfg.hidden_size)),
                  drafter_states=jax.random.normal(keys[1], (2, DEPTH, cfg.hidden_size)),
                  marginal_logits=2 * jax.random.normal(keys[2], (2, DEPTH, vocab)))
    return cfg, target, adapter, inputs


def children_sets(tree, b):
    tokens, parent, depth, valid = (np.asarray(x)[b] for x in tree)
    kids = {}
    for i in range(1, len(tokens)):
        if valid[i]:
            kids.setdefault(parent[i], set()).add(int(tokens[i]))
    return {i: (int(depth[i]), s) for i, s in kids.items()}


def incomparable_siblings_exist(tree, b) -> bool:
    """Two nodes at the same depth whose child sets are not prefixes of one ranking (neither
    contains the other): impossible when children depend on the depth alone."""
    sets = list(children_sets(tree, b).values())
    return any(d1 == d2 and not (s1 <= s2 or s2 <= s1) for i, (d1, s1) in enumerate(sets) for d2, s2 in sets[i + 1 :])


def test_zero_residual_gives_the_marginal_tree():
    cfg, target, adapter, x = setup()
    adapter.query[...] = jnp.zeros_like(adapter.query[...])
    tree = weaver_tree(adapter, adapter.tables(target), **x, budget=BUDGET, children=4, expansions=3,
                       pool_size=cfg.vocab_size)
    ref, _ = batched_best_first(x["root"], marginal_children(x["marginal_logits"], 4), None, budget=BUDGET,
                                children=4, expansions=3, max_depth=DEPTH)
    for a, b in zip(tree, ref, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not any(incomparable_siblings_exist(ref, b) for b in range(2))


def test_path_dependent_residual_gives_nodes_their_own_children():
    cfg, target, adapter, x = setup(seed=1)
    adapter.query[...] = 30 * adapter.query[...]  # a residual that dominates the marginals
    tree = weaver_tree(adapter, adapter.tables(target), **x, budget=BUDGET, children=3, expansions=3,
                       pool_size=cfg.vocab_size)
    check_valid_tree(tree, DEPTH)
    assert np.asarray(tree.valid).sum(1).tolist() == [BUDGET + 1] * 2
    assert all(incomparable_siblings_exist(tree, b) for b in range(2))


def node_step_cost(vocab: int) -> tuple[int, float]:
    """Parameters of the adapter and FLOPs of expanding the root, for a target of `vocab` tokens."""
    cfg, target, adapter, x = setup(vocab=vocab, pool=32)
    params = sum(p.size for p in jax.tree.leaves(nnx.state(adapter, nnx.Param)))
    tables = adapter.tables(target)
    pool_logits, pool_ids = jax.lax.top_k(x["marginal_logits"], 32)

    def expand_root(tables, pool_ids, pool_logits, root_state, drafter_states):
        cache = adapter.prefix(root_state, drafter_states, KVCache.init(adapter.config.block_config, 2, DEPTH + 1 + 9))
        state = WeaverState(cache, jnp.zeros((2, 9, 9), bool))
        zeros = jnp.zeros((2, 9), jnp.int32)
        tree = Tree(zeros, zeros - 1, zeros, jnp.ones((2, 9), bool))
        score = adapter_children(adapter, tables, pool_ids, pool_logits, DEPTH + 1)
        return score(state, tree, jnp.zeros((2, 1), jnp.int32), 4)[:2]

    compiled = jax.jit(expand_root).lower(tables, pool_ids, pool_logits, x["root_state"], x["drafter_states"]).compile()
    return params, compiled.cost_analysis()["flops"]


def test_node_step_cost_does_not_grow_with_the_vocabulary():
    small, large = node_step_cost(128), node_step_cost(4096)
    assert small[0] == large[0], "adapter parameters depend on V"
    assert small[1] == large[1], f"node-step FLOPs grow with V: {small[1]} vs {large[1]}"
