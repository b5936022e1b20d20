"""Static-shape proposal trees and the builders that share them (DESIGN 3.4).

A tree is `tokens, parent, depth, valid`, each `[B, N]`: node 0 is the root (the last bonus
token, depth 0, parent -1), parents come before children, invalid nodes are padding. Every
builder returns this form, so verification, acceptance and commit never depend on the method.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Tree(NamedTuple):
    """A batch of static-shape proposal trees, node 0 the root, parents before children (`proposal_tree` returns
    one as lists for inspection): tokens, parent (-1 at the root), depth `[B, N]` int32, valid `[B, N]` bool.

        tree = weaver_jax.Tree(tokens=jnp.array([[7, 3, 9, 4]]), parent=jnp.array([[-1, 0, 0, 1]]),
                               depth=jnp.array([[0, 1, 1, 2]]), valid=jnp.ones((1, 4), bool))
        tree.ancestors()[0, 3]                                            # [True, True, False, True]
    """

    tokens: jax.Array  # [B, N] int32
    parent: jax.Array  # [B, N] int32, -1 at the root
    depth: jax.Array  # [B, N] int32
    valid: jax.Array  # [B, N] bool

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def ancestors(self, max_depth: int | None = None) -> jax.Array:
        """`[B, N, N]` bool: node i sees node j iff j is i or an ancestor of i (invalid nodes
        see only themselves). By pointer doubling: after step k a node's row holds its ancestors at
        distances below 2^k, so ceil(log2(max_depth + 1)) steps (max_depth: the deepest node, at most
        N - 1) replace a loop over the nodes, which a GPU runs as one launch sequence per node."""
        b, n = self.tokens.shape
        steps = (n - 1 if max_depth is None else min(max_depth, n - 1)).bit_length()
        sentinel = jnp.full((b, 1), n, jnp.int32)  # row n: no node, its own "parent", sees nothing
        up = jnp.concatenate([jnp.where((self.parent >= 0) & self.valid, self.parent, n), sentinel], axis=1)
        seen = jnp.broadcast_to(jnp.eye(n + 1, n, dtype=bool), (b, n + 1, n))
        for _ in range(steps):
            seen = seen | jnp.take_along_axis(seen, up[:, :, None], axis=1)
            up = jnp.take_along_axis(up, up, axis=1)
        return seen[:, :n]


def round_loop(steps: int, body, carry):
    """`fori_loop(0, steps, body, carry)` for a fixed-trip loop inside a round: unrolled on a GPU,
    where XLA runs every iteration of a loop as its own launch sequence after a host-side check of
    the condition (DESIGN 4); rolled elsewhere, where iterations are cheap and compile time is not."""
    return jax.lax.fori_loop(0, steps, body, carry, unroll=jax.default_backend() == "gpu")


def row_get(a: jax.Array, columns: jax.Array) -> jax.Array:
    """`a[r, columns[r]]` for every row r: a `[B, N, ...]`, columns `[B]` or `[B, W]`. The batch is a batching
    dimension of the gather, so a batch split over a mesh's `data` axis stays split (indexing with
    `a[arange(B)[:, None], columns]` makes the rows an index like any other, which XLA's partitioner all-gathers)."""
    return jax.vmap(lambda row, c: row[c])(a, columns)


def row_set(a: jax.Array, columns: jax.Array, values, mode: str | None = None) -> jax.Array:
    """`a[r, columns[r]] = values[r]` for every row r (`row_get`'s scatter); values broadcast to the columns'
    shape (and a's trailing dimensions)."""
    values = jnp.broadcast_to(values, columns.shape + a.shape[2:])
    return jax.vmap(lambda row, c, v: row.at[c].set(v, mode=mode))(a, columns, values)


def row_add(a: jax.Array, columns: jax.Array, values) -> jax.Array:
    """`a[r, columns[r]] += values[r]` for every row r."""
    values = jnp.broadcast_to(values, columns.shape + a.shape[2:])
    return jax.vmap(lambda row, c, v: row.at[c].add(v))(a, columns, values)


def chunked_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` over the last axis of size V, in two smaller selections: the maxima of
    chunks of about sqrt(V / k) elements, the k chunks with the largest maxima, then the top k of
    their elements. Exact: fewer than k elements beat the maximum of the chunk holding a top-k
    element, so that chunk is among the k kept (among equal values the kept ids may differ). The
    drafter's pool and DDTree's ranks select from the full vocabulary every round; sorting a
    V-element row costs far more than two rows of ~sqrt(V k). -> (values, ids) `[..., k]`, descending."""
    v = x.shape[-1]
    chunk = 1 << max(0, round(math.log2(max(v / max(k, 1), 1)) / 2))
    while chunk > 1 and v % chunk:  # chunks tile the row exactly: no padding, no ids past V
        chunk //= 2
    if chunk < 4 or v // chunk < k:
        return jax.lax.top_k(x, k)
    chunks = x.reshape(*x.shape[:-1], v // chunk, chunk)
    _, best = jax.lax.top_k(jnp.max(chunks, axis=-1), k)  # [..., k] chunk indices
    candidates = jnp.take_along_axis(chunks, best[..., None], axis=-2).reshape(*x.shape[:-1], k * chunk)
    values, i = jax.lax.top_k(candidates, k)
    return values, jnp.take_along_axis(best, i // chunk, axis=-1) * chunk + i % chunk


def chain(root: jax.Array, marginal_logits: jax.Array) -> Tree:
    """DFlash: the argmax of each marginal in a chain. root `[B]`, marginal_logits `[B, K, V]`
    -> a tree of K + 1 nodes."""
    b, k, _ = marginal_logits.shape
    tokens = jnp.concatenate([root[:, None], jnp.argmax(marginal_logits, -1)], axis=1).astype(jnp.int32)
    parent = jnp.broadcast_to(jnp.arange(-1, k, dtype=jnp.int32), (b, k + 1))
    depth = jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32), (b, k + 1))
    return Tree(tokens, parent, depth, jnp.ones((b, k + 1), bool))


def extend_deepest(tree: Tree, marginal_logits: jax.Array, count: int) -> Tree:
    """`count` more nodes: a chain below the tree's deepest node (the first made among the deepest)
    along the marginals' argmax, as DFlash's chain continues - depth at no scorer call. Weaver's
    trees are at most as deep as its adapter calls, while on greedy text the drafter stays right for
    long confident stretches. marginal_logits `[B, K, V]` (marginal t proposes depth t + 1); chain
    nodes past depth K are invalid. -> a tree of N + count nodes."""
    b, k, _ = marginal_logits.shape
    leaf = jnp.argmax(jnp.where(tree.valid, tree.depth, -1), axis=1)  # [B]
    depth = jnp.take_along_axis(tree.depth, leaf[:, None], axis=1) + jnp.arange(1, count + 1)  # [B, count]
    tokens = jnp.take_along_axis(jnp.argmax(marginal_logits, -1).astype(jnp.int32), jnp.clip(depth - 1, 0, k - 1),
                                 axis=1)
    parent = jnp.concatenate([leaf[:, None], jnp.broadcast_to(tree.size + jnp.arange(count - 1), (b, count - 1))],
                             axis=1).astype(jnp.int32)
    return Tree(jnp.concatenate([tree.tokens, tokens], 1), jnp.concatenate([tree.parent, parent], 1),
                jnp.concatenate([tree.depth, depth], 1), jnp.concatenate([tree.valid, depth <= k], 1))


def ddtree(root: jax.Array, marginal_logits: jax.Array, budget: int) -> Tree:
    """DDTree: the exact top-`budget` prefixes by product of marginals, best first.

    root `[B]`, marginal_logits `[B, K, V]` -> a tree of `budget + 1` nodes. A frontier entry is
    a prefix not yet taken: (score, parent node, depth, rank of its last token at that depth).
    Popping the best one materialises it as a node and pushes its next sibling (same parent,
    rank + 1) and its first child (rank 0 one level deeper). Scores only fall along both moves,
    so the popped set is exactly the top `budget`, and prefix-closed."""
    b, k, v = marginal_logits.shape
    ranks = min(budget, v)  # a tree of `budget` nodes never uses a deeper rank
    logits = marginal_logits.astype(jnp.float32)
    logp, ids = chunked_top_k(logits, ranks)  # [B, K, R]
    logp = logp - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    slots = 2 * budget + 1
    neg = -jnp.inf

    frontier = dict(
        score=jnp.full((b, slots), neg).at[:, 0].set(logp[:, 0, 0]),
        parent=jnp.zeros((b, slots), jnp.int32),
        depth=jnp.ones((b, slots), jnp.int32),
        rank=jnp.zeros((b, slots), jnp.int32),
        base=jnp.zeros((b, slots), jnp.float32),  # score of the parent prefix
    )
    tree = Tree(
        tokens=jnp.zeros((b, budget + 1), jnp.int32).at[:, 0].set(root),
        parent=jnp.full((b, budget + 1), -1, jnp.int32),
        depth=jnp.zeros((b, budget + 1), jnp.int32),
        valid=jnp.zeros((b, budget + 1), bool).at[:, 0].set(True))
    pick = jax.vmap(lambda a, depth, rank: a[depth, rank])  # `a[r, depth[r], rank[r]]` per row, as `row_get`

    def pop(step, carry):
        tree, f, used = carry
        node = step + 1
        best = jnp.argmax(f["score"], axis=1)
        score = row_get(f["score"], best)
        ok = score > neg
        par, dep = row_get(f["parent"], best), row_get(f["depth"], best)
        rank, base = row_get(f["rank"], best), row_get(f["base"], best)
        token = pick(ids, dep - 1, rank)
        tree = Tree(tree.tokens.at[:, node].set(jnp.where(ok, token, 0)),
                    tree.parent.at[:, node].set(jnp.where(ok, par, -1)),
                    tree.depth.at[:, node].set(jnp.where(ok, dep, 0)),
                    tree.valid.at[:, node].set(ok))
        f = {**f, "score": row_set(f["score"], best, neg)}
        sib_ok = ok & (rank + 1 < ranks)
        child_ok = ok & (dep < k)
        sib_score = jnp.where(sib_ok, base + pick(logp, dep - 1, jnp.minimum(rank + 1, ranks - 1)), neg)
        child_score = jnp.where(child_ok, score + pick(logp, jnp.minimum(dep, k - 1), jnp.zeros_like(dep)), neg)
        for offset, (s, p, d, r, bs) in enumerate([(sib_score, par, dep, rank + 1, base),
                                                    (child_score, jnp.full_like(par, node), dep + 1,
                                                     jnp.zeros_like(rank), score)]):
            slot = used + offset
            f = {"score": f["score"].at[:, slot].set(s), "parent": f["parent"].at[:, slot].set(p),
                 "depth": f["depth"].at[:, slot].set(d), "rank": f["rank"].at[:, slot].set(r),
                 "base": f["base"].at[:, slot].set(bs)}
        return tree, f, used + 2

    tree, _, _ = round_loop(budget, pop, (tree, frontier, jnp.int32(1)))
    return tree


def marginal_children(marginal_logits: jax.Array, widest: int):
    """A child scorer that ignores the path: a node at depth t offers the top-`width` tokens of
    marginal t + 1 (DDTree's scores), `width` <= `widest` (the top-`widest` are ranked once, here,
    not in every call). marginal_logits `[B, K, V]`. The Weaver adapter is the path-dependent scorer
    with the same signature."""
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(marginal_logits.astype(jnp.float32), -1), widest)  # [B, K, widest]
    k = marginal_logits.shape[1]

    def score(state, tree: Tree, nodes: jax.Array, width: int):
        if width > widest:
            raise ValueError(f"the scorer ranked the top {widest} children, {width} were asked for")
        d = jnp.clip(jnp.take_along_axis(tree.depth, nodes, axis=1), 0, k - 1)[:, :, None]  # [B, w, 1]: depth - 1
        # lax.top_k keeps the lower index first among ties, so the top-width are a prefix of the top-widest
        return (jnp.take_along_axis(ids, d, axis=1)[..., :width], jnp.take_along_axis(logp, d, axis=1)[..., :width],
                state)

    return score


def search_calls(budget: int, children: int, expansions: int, max_depth: int, root_children: int | None = None) -> int:
    """Scorer calls after the root's that give `batched_best_first` `budget` nodes (or every prefix
    the depth limit leaves, if fewer) whatever the scores: the count with the frontier's deepest
    entries taken first, which publish the fewest children. A static number, so the search is a
    fixed-trip loop (unrolled on a GPU) instead of a while loop that checks the frontier each call."""
    frontier = [0] * (max_depth + 1)  # entries per depth
    if max_depth:
        frontier[1] = children if root_children is None else root_children
    left, calls = budget, 0
    while left > 0 and any(frontier):
        take = min(expansions, left)
        for depth in range(max_depth, 0, -1):
            taken = min(take, frontier[depth])
            frontier[depth] -= taken
            take, left = take - taken, left - taken
            if depth < max_depth:
                frontier[depth + 1] += taken * children
        calls += 1
    return calls


def batched_best_first(root: jax.Array, score_children, state, *, budget: int, children: int, expansions: int,
                       max_depth: int, root_children: int | None = None) -> tuple[Tree, object]:
    """Weaver's tree search (DESIGN 3.4): the root publishes its top-`root_children` children
    (default: `children`), every later node its top-`children`, with cumulative log-probabilities
    into a frontier of `r + budget * c` slots (the root owns slots `[0, r)`, node i >= 1 slots
    `[r + (i - 1) * c, r + i * c)`); each call takes the best `expansions` entries, materialises
    them as the next nodes and expands them together, so a tree costs `search_calls(...)` scorer
    calls (about `budget / expansions`) after the root's. A wider root offers the first tokens
    that sampled text often takes outside a node's top few (BENCHMARKS, issue 19).

    score_children(state, tree, nodes [B, w], width) -> (tokens [B, w, width], logp [B, w, width],
    state): the top-`width` children of each node in `nodes` and their log-probabilities given the
    node's path.
    root `[B]` -> (a tree of `budget + 1` nodes, exactly `budget` of them valid past the root
    unless the frontier runs dry; the scorer's final state)."""
    b, c, w = root.shape[0], children, expansions
    r = c if root_children is None else root_children
    n = budget + 1
    f = r + budget * c  # frontier slots
    tree = Tree(tokens=jnp.zeros((b, n), jnp.int32).at[:, 0].set(root), parent=jnp.full((b, n), -1, jnp.int32),
                depth=jnp.zeros((b, n), jnp.int32), valid=jnp.zeros((b, n), bool).at[:, 0].set(True))

    def publish(tree, node_score, frontier, front_tokens, state, nodes, ok, width, first):
        tokens, logp, state = score_children(state, tree, nodes, width)
        node_depth = jnp.take_along_axis(tree.depth, nodes, axis=1)
        cum = jnp.take_along_axis(node_score, nodes, axis=1)[:, :, None] + logp
        cum = jnp.where((ok & (node_depth < max_depth))[:, :, None], cum, -jnp.inf)
        slots = jnp.where(ok[:, :, None], first[:, :, None] + jnp.arange(width), f).reshape(b, -1)
        return (row_set(frontier, slots, cum.reshape(b, -1), mode="drop"),
                row_set(front_tokens, slots, tokens.reshape(b, -1), mode="drop"), state)

    node_score = jnp.zeros((b, n), jnp.float32)
    root_node = jnp.zeros((b, 1), jnp.int32)
    frontier, front_tokens, state = publish(
        tree, node_score, jnp.full((b, f), -jnp.inf), jnp.zeros((b, f), jnp.int32), state, root_node,
        jnp.ones((b, 1), bool), r, root_node)

    def call(_, carry):
        tree, node_score, frontier, front_tokens, state, count = carry
        best, slots = jax.lax.top_k(frontier, w)  # [B, w], best first: the finite ones are a prefix
        nodes = count[:, None] + jnp.arange(w)[None, :]
        ok = jnp.isfinite(best) & (nodes < n)
        nodes = jnp.minimum(nodes, n - 1)
        parent = jnp.where(slots < r, 0, (slots - r) // c + 1)
        put = lambda a, v: row_set(a, jnp.where(ok, nodes, n), v, mode="drop")  # noqa: E731
        tree = Tree(put(tree.tokens, jnp.take_along_axis(front_tokens, slots, axis=1)), put(tree.parent, parent),
                    put(tree.depth, jnp.take_along_axis(tree.depth, parent, axis=1) + 1), put(tree.valid, ok))
        node_score = put(node_score, best)
        frontier = row_set(frontier, jnp.where(ok, slots, f), -jnp.inf, mode="drop")
        frontier, front_tokens, state = publish(tree, node_score, frontier, front_tokens, state, nodes, ok, c,
                                                r + (nodes - 1) * c)
        return tree, node_score, frontier, front_tokens, state, count + ok.sum(1)

    carry = (tree, node_score, frontier, front_tokens, state, jnp.ones((b,), jnp.int32))
    out = round_loop(search_calls(budget, c, w, max_depth, r), call, carry)
    return out[0], out[4]
