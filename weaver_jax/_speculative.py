"""Speculative generation: draft a tree, verify it in one target pass, accept, commit (DESIGN 2).

The whole generation is one `lax.while_loop` under `jax.jit`. Per round:
  1. the drafter proposes marginals for the `b - 1` positions after the root (the last bonus token);
  2. a builder turns them into a static tree (`chain` for DFlash, `ddtree`, or the Weaver
     adapter's batched best-first search) - when the target samples, from the marginals perturbed by
     the Gumbel noise of the very draws that will verify them (`coupled_drafts`);
  3. the target verifies every node at position `len + depth` under the ancestor mask; the nodes'
     K/V land in the scratch slots `[len, len + N)`;
  4. the acceptance walk starts at the root: draw the target's token at the current node (argmax,
     or a sample of the filtered distribution); move to the child carrying it, else it is the bonus;
  5. commit: the K/V of the accepted path (root included) move to `[len, len + m + 1)` and `len`
     advances; the drafter's context grows by the same tokens. Nothing else is ever undone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from weaver_jax._adapter import Tables, weaver_tree
from weaver_jax._model import ForwardOutput, KVCache, _write
from weaver_jax._sampling import Sampling, choose, draw_noise, select
from weaver_jax._tree import Tree, chain, ddtree, row_add, row_get, row_set
from weaver_jax.pallas_kernels import kernel_scope, kernels_enabled

METHODS = ("dflash", "ddtree", "weaver")
_GREEDY = Sampling()
MAX_BUDGET = 4096
DEFAULT_BUDGET = {"ddtree": 64, "weaver": 24}  # weaver: the measured best at B = 1 on an H200 (BENCHMARKS.md)
# Weaver's candidates per depth: the pool only bounds what may be proposed, and its top-k is the round's costliest
# selection; 64 of the shipped adapter's 512 cost 1% of greedy τ and measured fastest on an H200 (BENCHMARKS.md)
DEFAULT_POOL = 64
# A target of a billion parameters or more streams gigabytes a step, so a tree costs its rows, not its kernel
# launches: budgets whose node count fills a 16 / 32 / 64-row product tile, smaller as the batch grows (on an
# H200 at the Qwen3-8B and Qwen3.6-27B shapes, BENCHMARKS.md "projected speedup at scale": Weaver 63 at B = 1,
# 15 at B = 8; DDTree 31 and 15)
LARGE_TARGET_PARAMETERS = 10**9
_LARGE_BUDGETS = {"weaver": (63, 31, 15), "ddtree": (31, 15)}  # the largest whose rows B x (budget + 1) fit
_LARGE_ROWS = {"weaver": 128, "ddtree": 64}


def default_budget(method: str, batch: int = 1, target_parameters: int = 0) -> int:
    """The tree budget `generate` uses when none is given, for this batch size and target size."""
    if target_parameters < LARGE_TARGET_PARAMETERS:
        return DEFAULT_BUDGET[method]
    budgets = _LARGE_BUDGETS[method]
    return next((b for b in budgets if batch * (b + 1) <= _LARGE_ROWS[method]), budgets[-1])


def tree_options(method: str, options: dict, *, block_size: int, vocab_size: int, pool_size: int = 0,
                 max_depth: int | None = None, sampled: bool = False, batch: int = 1,
                 target_parameters: int = 0) -> dict:
    """Validate a method's options against the drafter (its block size and vocabulary) and, for
    "weaver", the adapter (its pool size, which caps the default `pool_size`, and max depth);
    returns the static options of the round (`sampled`: their defaults for sampled decoding; `batch` and
    `target_parameters` pick the default budget, `default_budget`).
    Every method takes `depth`: the deepest tree node (default and maximum: block_size - 1, and the
    adapter's K for "weaver"); the drafter projects only that many positions to the vocabulary."""
    deepest = block_size - 1 if max_depth is None else min(block_size - 1, max_depth)
    options = dict(options)
    if "block_size" in options:
        requested = options.pop("block_size")
        if requested != block_size:
            raise ValueError(f"block_size={requested} was requested but the drafter was trained with {block_size}")
    depth = options.pop("depth", deepest)
    if not isinstance(depth, int) or not 1 <= depth <= deepest:
        raise ValueError(f"depth must be an integer in [1, {deepest}], got {depth!r}")
    if method == "dflash":
        if options:
            raise TypeError(f"method 'dflash' takes no options besides block_size and depth, got {sorted(options)}")
        return {"depth": depth}
    budget = options.pop("budget") if "budget" in options else default_budget(method, batch, target_parameters)
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
    branching = vocab_size
    extra = {}
    if method == "weaver":
        pool = options.pop("pool_size", min(pool_size, DEFAULT_POOL))
        if not isinstance(pool, int) or not 1 <= pool <= vocab_size:
            raise ValueError(f"pool_size must be an integer in [1, {vocab_size}], got {pool!r}")
        children = options.pop("children_per_node", min(8, pool))
        if not isinstance(children, int) or not 1 <= children <= pool:
            raise ValueError(f"children_per_node must be an integer in [1, pool_size={pool}], got {children!r}")
        # about three adapter calls after the root's (fewer, wider calls measured faster on an H200), but
        # at most 8 nodes a call: a tree is at most as deep as its calls, and on the H200 8 per call at
        # budget 64 was both faster and +21% τ against 22 (BENCHMARKS, issue 19)
        expansions = options.pop("expansions_per_call", min(8, -(-budget // 3)))
        if not isinstance(expansions, int) or not 1 <= expansions <= budget:
            raise ValueError(f"expansions_per_call must be an integer in [1, budget={budget}], got {expansions!r}")
        # a sixth of the budget, at most 8, continues the deepest node along the drafter's argmax: depth at no
        # adapter call (+13% τ, +9% tokens/s at the default budget on an H200; BENCHMARKS, issue 19, fifth pass)
        tail = options.pop("marginal_tail", min(8, budget // 6))
        if not isinstance(tail, int) or not 0 <= tail < budget:
            raise ValueError(f"marginal_tail must be an integer in [0, budget={budget}) (at least one node is "
                             f"searched), got {tail!r}")
        # the root's children: the first tokens on offer. Sampled text often starts outside a node's top 8:
        # 32 children per node measured +4% τ at T = 1 at budget 64 on an H200, nine tenths of it (CPU
        # proxy) from the root's; nothing at budget 24, greedy τ the same on greedy text (BENCHMARKS, issue 19)
        wide = min(pool, max(children, budget // 2)) if sampled else children
        root = options.pop("root_children", wide)
        if not isinstance(root, int) or not 1 <= root <= pool:
            raise ValueError(f"root_children must be an integer in [1, pool_size={pool}], got {root!r}")
        branching = children
        extra = dict(pool_size=pool, children=children, root_children=root, expansions=expansions, prefix=deepest,
                     tail=tail)
    if options:
        raise TypeError(f"method {method!r} got unknown options {sorted(options)}")
    first = extra.get("root_children", branching)
    prefixes = sum(min(first * branching ** (d - 1), MAX_BUDGET + 1) for d in range(1, depth + 1))
    if budget > min(prefixes, MAX_BUDGET):
        raise ValueError(f"budget={budget} is larger than the frontier allows: at most {min(prefixes, MAX_BUDGET)} "
                         f"distinct prefixes of depth <= {depth} with {branching} children per node (cap {MAX_BUDGET})")
    return {"budget": budget, "depth": depth, **extra}


def build_tree(method: str, root: jax.Array, marginal_logits: jax.Array, options: dict) -> Tree:
    if method == "dflash":
        return chain(root, marginal_logits)
    if method == "ddtree":
        return ddtree(root, marginal_logits, options["budget"])
    raise ValueError(f"unknown method {method!r}")


class Acceptance(NamedTuple):
    path: jax.Array  # [B, K + 1] node indices of the accepted path, root first; padded with 0
    length: jax.Array  # [B] accepted nodes including the root (m + 1)
    bonus: jax.Array  # [B] the target's token at the last accepted node


def accept(tree: Tree, logits: jax.Array, keys: jax.Array, first_step: jax.Array, sampling: Sampling,
           max_depth: int, ancestors: jax.Array | None = None) -> Acceptance:
    """Walk from the root: draw the target's token y at the current node; move to the valid child
    carrying y, else y is the bonus. logits `[B, N, V]`, keys `[B]` (one per sequence), first_step
    `[B]`: the index among the sequence's generated tokens of the token drawn at the root (see
    `node_steps`); max_depth: the deepest node a builder can make (paths hold at most max_depth + 1
    nodes); ancestors: `tree.ancestors()` when already made."""
    return walk_choices(tree, tree_choices(tree, logits, keys, first_step, sampling), max_depth, ancestors)


def node_steps(tree: Tree, first_step: jax.Array) -> jax.Array:
    """`[B, N]`: the index among its sequence's generated tokens of the token each node's draw is for,
    `first_step + depth`. `ar` keys the draw of generated token t with `fold_in(key, t)` too, so every
    method samples exactly `ar`'s tokens for a seed: the accepted path uses each step's key once, for
    the token emitted there, and draws on other branches are never emitted."""
    return first_step[:, None] + tree.depth


def tree_choices(tree: Tree, logits: jax.Array, keys: jax.Array | None, first_step: jax.Array | None,
                 sampling: Sampling) -> jax.Array:
    """`node_choices` keyed by `node_steps(tree, first_step)` (greedy needs neither keys nor steps)."""
    return node_choices(logits, keys, None if sampling.greedy else node_steps(tree, first_step), sampling)


def node_choices(logits: jax.Array, keys: jax.Array, steps: jax.Array, sampling: Sampling) -> jax.Array:
    """The token the target draws at every node, `[B, N]`: its argmax, or a sample of the filtered
    distribution keyed by `steps [B, N]` (`node_steps`) - what the walk reads, and the acceptance
    kernel too. The plain reference of `depth_choices`."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.vmap(lambda node_logits, step: select(node_logits, keys, step, sampling), in_axes=(1, 1), out_axes=1)(
        logits, steps)


def depth_noise(keys: jax.Array, first_step: jax.Array, depths: int, size: int) -> jax.Array:
    """`[B, depths, size]`: the Gumbel noise (`draw_noise`) of the draws at depths 0 .. depths - 1 of a
    round whose root draws generated token `first_step [B]` (`node_steps`). The nodes of one depth
    share their draw's key, so a round draws its noise once per depth, not once per node."""
    return jax.vmap(lambda t: draw_noise(keys, first_step + t, size), out_axes=1)(jnp.arange(depths))


def depth_choices(tree: Tree, logits: jax.Array, noise: jax.Array | None, sampling: Sampling) -> jax.Array:
    """`tree_choices` from the round's `depth_noise` `[B, >= max depth + 1, V]` (None when greedy): the
    same tokens, with the noise drawn once per depth and read by each node at its depth."""
    by_node = None if sampling.greedy else jnp.take_along_axis(noise, tree.depth[:, :, None], axis=1)  # [B, N, V]
    return choose(logits, by_node, sampling)


def walk_choices(tree: Tree, choice: jax.Array, max_depth: int, ancestors: jax.Array | None = None) -> Acceptance:
    """The acceptance walk over per-node target tokens `choice [B, N]`: from the root, move to the
    valid child carrying the current node's choice (the lowest index if several), else that choice
    is the bonus. Without a loop over depth: a node is on the path iff it and every ancestor past the
    root is the child its parent's choice selects. ancestors: `tree.ancestors()` when already made."""
    n = choice.shape[1]
    ancestors = tree.ancestors(max_depth) if ancestors is None else ancestors
    index = jnp.arange(n)
    hit = tree.valid & (tree.parent >= 0) & (
        tree.tokens == jnp.take_along_axis(choice, jnp.maximum(tree.parent, 0), axis=1))
    earlier_sibling = (tree.parent[:, None, :] == tree.parent[:, :, None]) & (index[None, :] < index[:, None])
    selected = (hit & ~jnp.any(earlier_sibling & hit[:, None, :], axis=2)) | (index == 0)
    on_path = ~jnp.any(ancestors & ~selected[:, None, :], axis=2)  # [B, N]
    length = on_path.sum(1, dtype=jnp.int32)
    at_depth = on_path[:, None, :] & (tree.depth[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])
    path = jnp.sum(jnp.where(at_depth, index, 0), axis=2, dtype=jnp.int32)  # [B, max_depth + 1]
    last = jnp.take_along_axis(path, (length - 1)[:, None], axis=1)
    return Acceptance(path, length, jnp.take_along_axis(choice, last, axis=1)[:, 0])


def accept_and_move(tree: Tree, logits: jax.Array | None, cache: KVCache, keys: jax.Array | None,
                    first_step: jax.Array | None, sampling: Sampling, max_depth: int,
                    choice: jax.Array | None = None, ancestors: jax.Array | None = None) -> tuple[Acceptance, KVCache]:
    """`accept`, and the accepted nodes' K/V moved to `[len, len + length)` (lengths unchanged: the
    caller advances them by what it emits). With kernels on, one Pallas walk + in-place commit.
    choice `[B, N]`: the per-node target tokens (`node_choices`) when already known; then `logits`
    `keys` and `first_step` are unused. ancestors: `tree.ancestors()` when already made (the XLA walk reads it)."""
    choice = tree_choices(tree, logits, keys, first_step, sampling) if choice is None else choice
    if kernels_enabled("accept_commit") and cache.k:  # (a hybrid target may have no attention layer)
        from weaver_jax._sharding import cache_specs
        from weaver_jax.pallas_kernels import interpret
        from weaver_jax.pallas_kernels._call import batch_heads, context_mesh, per_shard
        from weaver_jax.pallas_kernels.accept_commit import accept_commit

        # per device: its sequences' walks, and the moves of its K/V heads (the cache split as it is placed)
        mesh = context_mesh()
        cache_spec = cache_specs(cache, mesh.shape["model"] if mesh is not None else 1)
        return per_shard(lambda t, c, kv: accept_commit(t, c, kv, max_depth=max_depth, interpret=interpret()),
                         (tree, choice, cache), (jax.tree.map(lambda a: batch_heads(a.ndim), tree), batch_heads(2),
                                                 cache_spec),
                         (Acceptance(batch_heads(2), batch_heads(1), batch_heads(1)), cache_spec))
    acc = walk_choices(tree, choice, max_depth, ancestors)
    return acc, commit_kv(cache, acc.path)


def commit_kv(cache: KVCache, path: jax.Array) -> KVCache:
    """Move the K/V of the path nodes (scratch slots `len + path`, `[B, P]`) to `[len, len + P)`;
    lengths unchanged (the caller advances them by what it emits; slots past that are free space).
    Writes all P rows from `len`, so it needs `len + P <= S` (generate's caches leave room for a tree)."""
    src = cache.lengths[:, None] + path  # [B, P]

    def move(layer):
        return _write(layer, jnp.take_along_axis(layer, src[:, :, None, None], axis=1), cache.lengths)

    return dataclasses.replace(cache, k=tuple(move(k) for k in cache.k), v=tuple(move(v) for v in cache.v))


class SpecState(NamedTuple):
    rounds: jax.Array  # scalar: loop iterations
    root: jax.Array  # [B] last emitted token, not yet in the cache
    root_state: jax.Array  # [B, D] ("weaver") the target's final normed state that produced root
    cache: KVCache
    drafter_cache: KVCache
    tokens: jax.Array  # [B, max_new_tokens] (max_new_tokens: the buffer's width)
    num_tokens: jax.Array  # [B]
    done: jax.Array  # [B]
    seq_rounds: jax.Array  # [B] verifications that emitted tokens for this sequence
    histogram: jax.Array  # [B, K + 2]: rounds by tokens emitted (accepted + bonus)


class SpecOutput(NamedTuple):
    """`spec_generate`'s result (arrays on the device): `ar_generate`'s tokens `[B, max_new_tokens]` and counts
    `[B]`, the rounds (verifications) per sequence `[B]` and of the longest, the histogram of tokens emitted per
    verification `[B, K + 2]`, and both committed caches:

        out = weaver_jax.spec_generate(params, drafter_params, cache, drafter_cache, prompts, prompt_lengths, keys, ...)
        out.num_tokens / out.seq_rounds                                   # τ per sequence
    """

    tokens: jax.Array  # [B, max_new_tokens], -1 past num_tokens
    num_tokens: jax.Array  # [B]
    rounds: jax.Array  # scalar: verification rounds of the longest sequence
    seq_rounds: jax.Array  # [B]
    histogram: jax.Array  # [B, K + 2]
    cache: KVCache
    drafter_cache: KVCache


def _emit(tokens, num_tokens, new, count):
    """Write `new [B, P]`'s first `count [B]` tokens after each sequence's `num_tokens`."""
    p = new.shape[1]
    cols = num_tokens[:, None] + jnp.arange(p)[None, :]
    cols = jnp.where(jnp.arange(p)[None, :] < count[:, None], cols, tokens.shape[1])  # out of range: dropped
    return row_set(tokens, cols, new, mode="drop")


def _truncate(new, count, eos_ids, room):
    """Tokens emitted this round stop after the first EOS (`eos_ids`: a tuple or an int32 array, -1 pads it) and at
    the room left: -> (count, hit)."""
    p = new.shape[1]
    eos = jnp.asarray(eos_ids, jnp.int32).reshape(-1)
    if eos.size:
        is_eos = jnp.isin(new, eos) & (jnp.arange(p)[None, :] < count[:, None])
        first = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, p + 1)
        count = jnp.minimum(count, first)
        hit = first <= p
    else:
        hit = jnp.zeros(count.shape, bool)
    hit = hit & (count <= room)
    return jnp.minimum(count, room), hit


class _Parts(NamedTuple):
    """What a round needs, merged from params inside the jitted function."""

    target: object
    drafter: object
    adapter: object
    tables: object
    method: str
    opts: dict
    layer_ids: tuple[int, ...]
    hidden_ids: tuple[int, ...]
    depth: int
    exact: bool  # the target's row-invariant forward (`Transformer.__call__`)


def _parts(params, drafter_params, adapter_params, graphdef, drafter_graphdef, adapter_graphdef, method, options,
           exact, tables=None):
    target = nnx.merge(graphdef, params)
    drafter = nnx.merge(drafter_graphdef, drafter_params)
    layer_ids = tuple(drafter.config.target_layer_ids)
    adapter = None
    if method == "weaver":
        adapter = nnx.merge(adapter_graphdef, adapter_params)
        if tables is None:  # once per call, not per round
            tables = adapter.tables(target)
    options = dict(options)
    if "depth" not in options:
        raise ValueError(f"spec_generate's options must be the method's resolved options, 'depth' among them (got "
                         f"{sorted(options)}): e.g. options=(('depth', {drafter.config.block_size - 1}),) for the "
                         "chain; generate fills them in")
    return _Parts(target, drafter, adapter, tables, method, options, layer_ids, layer_ids, options["depth"], exact)


def _keeping_state(p: _Parts, root_state: jax.Array) -> _Parts:
    """`p` reading the target's last layer too when the state carries the root's final normed state: "weaver"
    needs it, and every tier of method="auto" keeps it for a Weaver round that may follow (`root_state [B, D]`, D
    = 0 where no round needs it)."""
    if not root_state.shape[-1]:
        return p
    return p._replace(hidden_ids=p.layer_ids + (p.target.config.num_layers - 1,))


def _final_state(p: _Parts, hidden, index):  # [B, T, D] last-layer outputs, index [B] -> [B, D] normed
    return p.target.final_state(jnp.take_along_axis(hidden[-1], index[:, None, None], axis=1)[:, 0])


def _prefill(p: _Parts, cache, drafter_cache, prompts, prompt_lengths, keys, sampling, eos_ids,
             max_new_tokens, limit=None) -> SpecState:
    """max_new_tokens: the tokens buffer's width; limit (traced; default max_new_tokens): the most a sequence emits."""
    limit = max_new_tokens if limit is None else limit
    b, t = prompts.shape
    positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
    keeps_state = p.method == "weaver"
    p = _keeping_state(p, jnp.zeros((b, int(keeps_state))))
    out = p.target.prefill(prompts, cache, prompt_lengths, logits_rows=(prompt_lengths - 1)[:, None],
                           hidden_layers=p.hidden_ids, exact=p.exact)
    drafter_cache = p.drafter.commit(drafter_cache, out.hidden[: len(p.layer_ids)], positions, prompt_lengths)
    cache = out.cache
    first = select(out.logits[:, 0], keys, jnp.int32(0), sampling)
    count, hit = _truncate(first[:, None], jnp.ones((b,), jnp.int32), eos_ids, jnp.full((b,), limit))
    return SpecState(
        rounds=jnp.int32(0), root=first,
        root_state=_final_state(p, out.hidden, prompt_lengths - 1) if keeps_state else jnp.zeros((b, 0)),
        cache=cache, drafter_cache=drafter_cache,
        tokens=_emit(jnp.full((b, max_new_tokens), -1, jnp.int32), jnp.zeros((b,), jnp.int32), first[:, None],
                     count),
        num_tokens=count, done=hit | (count >= limit), seq_rounds=jnp.zeros((b,), jnp.int32),
        histogram=jnp.zeros((b, p.depth + 2), jnp.int32))


def coupled_drafts(marginal_logits: jax.Array, noise: jax.Array | None, sampling: Sampling) -> jax.Array:
    """The scores a tree is built from when the target samples: the drafter's logits `[B, K, V]` at the
    sampling temperature plus, at depth t + 1, the Gumbel noise of the target's draw that decides that
    depth (the round's `depth_noise [B, >= K, V]` at depth t, the draw at the depth-t node). The
    target draws argmax(its filtered logits + that noise), so where the drafter's distribution is
    close to the target's, its perturbed argmax is the token the target will draw (1 - TV-like
    acceptance where unperturbed drafts get the target's probability of the drafter's argmax). The
    verification is unchanged - the walk follows the target's own draws -, so the output stays `ar`'s
    for the seed; greedy decoding keeps the logits as they are."""
    if sampling.greedy:
        return marginal_logits
    k = marginal_logits.shape[1]
    return marginal_logits.astype(jnp.float32) / sampling.temperature + noise[:, :k]


def _propose_and_verify(p: _Parts, s: SpecState, noise: jax.Array | None = None,
                        sampling: Sampling = _GREEDY) -> tuple[Tree, jax.Array, ForwardOutput]:
    """Draft, build the tree (from `coupled_drafts` when sampling: the round's `depth_noise`) and run
    the target over it (its K/V written past the prefix): -> (the tree, its ancestor table `[B, N, N]`,
    the target's forward)."""
    # named scopes: the stages a profile of the round reports (bench/round_profile.py)
    with jax.named_scope("drafter"):
        marginals, states = p.drafter.propose(p.target, s.cache, s.root, s.drafter_cache, depth=p.depth)
        if marginals.shape[1] != p.depth:  # a tree deeper than the round expects would be walked wrongly
            raise ValueError(f"the drafter proposed {marginals.shape[1]} positions, the round asked for {p.depth}")
        marginals = coupled_drafts(marginals, noise, sampling)
    with jax.named_scope("tree"):
        if p.method == "weaver":  # the adapter's prefix: the drafter states of all the depths it was made for
            tree = weaver_tree(p.adapter, p.tables, s.root, s.root_state, states[:, : p.opts["prefix"]], marginals,
                               budget=p.opts["budget"], children=p.opts["children"],
                               expansions=p.opts["expansions"], pool_size=p.opts["pool_size"],
                               marginal_tail=p.opts["tail"], root_children=p.opts["root_children"])
        else:
            tree = build_tree(p.method, s.root, marginals, p.opts)
        ancestors = tree.ancestors(p.depth)
    with jax.named_scope("verify"):
        verify = p.target(tree.tokens, s.cache.lengths[:, None] + tree.depth, s.cache, ancestors,
                          hidden_layers=p.hidden_ids, exact=p.exact)
    return tree, ancestors, verify


def round_noise(p: _Parts, s: SpecState, keys: jax.Array, sampling: Sampling) -> jax.Array | None:
    """The round's `depth_noise` `[B, depth + 1, V]` (None when greedy): the root's draw is for generated
    token num_tokens, with the same keys as `ar` (`node_steps`)."""
    if sampling.greedy:
        return None
    return depth_noise(keys, s.num_tokens, p.depth + 1, p.target.config.vocab_size)


def _round(p: _Parts, s: SpecState, keys, sampling, eos_ids, limit) -> tuple[SpecState, Tree, Acceptance]:
    """One round: draft, build the tree, verify, accept, commit (limit: the most tokens a sequence emits, <= the
    tokens buffer's width). -> (state, the tree, its acceptance)."""
    b = s.root.shape[0]
    p = _keeping_state(p, s.root_state)
    noise = round_noise(p, s, keys, sampling)
    tree, ancestors, verify = _propose_and_verify(p, s, noise, sampling)
    with jax.named_scope("accept"):
        acc, moved = accept_and_move(tree, None, verify.cache, None, None, sampling, p.depth,
                                     choice=depth_choices(tree, verify.logits, noise, sampling), ancestors=ancestors)
    path = acc.path

    new = jnp.take_along_axis(tree.tokens, path, axis=1)  # root first; shift: accepted then bonus
    new = jnp.concatenate([new[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    new = row_set(new, acc.length - 1, acc.bonus)
    last = jnp.take_along_axis(path, (acc.length - 1)[:, None], axis=1)[:, 0]
    return _emit_round(p, s, verify, moved, path, new, acc.length, last, eos_ids, limit), tree, acc


def _emit_round(p: _Parts, s: SpecState, verify: ForwardOutput, cache: KVCache, path, new, length, last, eos_ids,
                limit) -> SpecState:
    """A round's end: emit `new [B, P]`'s first `length [B]` tokens (cut at EOS and at max_new_tokens), commit the
    accepted nodes `path [B, P]` (root first; their K/V already moved in `cache`) to the target and their features
    to the drafter, and make the last emitted token the next root (produced at node `last [B]`)."""
    active = ~s.done
    count, hit = _truncate(new, length, eos_ids, limit - s.num_tokens)
    count = jnp.where(active, count, 0)
    tokens = _emit(s.tokens, s.num_tokens, new, count)
    num_tokens = s.num_tokens + count
    done = s.done | (active & hit) | (num_tokens >= limit)

    committed_positions = s.cache.lengths[:, None] + jnp.arange(path.shape[1])[None, :]
    features = tuple(jnp.take_along_axis(h, path[:, :, None], axis=1) for h in verify.hidden[: len(p.layer_ids)])
    # The root and the first count - 1 accepted nodes enter the cache; the last emitted token
    # (the bonus, unless EOS or max_new_tokens cut the round short) is the next root.
    with jax.named_scope("drafter_commit"):
        drafter_cache = p.drafter.commit(s.drafter_cache, features, committed_positions, count)
    cache = p.target.commit(cache, verify.pending, path, count)  # a hybrid target folds its GDN states here
    histogram = row_add(s.histogram, length, active.astype(jnp.int32))
    root = jnp.where(active, row_get(new, jnp.maximum(count - 1, 0)), s.root)
    root_state = s.root_state
    if root_state.shape[-1]:  # the state of the last accepted node produced the bonus, the next root
        root_state = jnp.where(active[:, None], _final_state(p, verify.hidden, last), s.root_state)
    return SpecState(s.rounds + 1, root, root_state, cache, drafter_cache, tokens, num_tokens, done,
                     s.seq_rounds + active, histogram)


def _step(p: _Parts, s: SpecState, keys, sampling, eos_ids, limit) -> SpecState:
    """A round with no draft (method "ar" inside a speculative state: method="auto"'s plain tier): `ar`'s decode
    step at the root, its token drawn with the same key, and the root's features committed to the drafter's
    context so that a drafted round can follow."""
    p = _keeping_state(p, s.root_state)
    verify = p.target(s.root[:, None], s.cache.lengths[:, None], s.cache, hidden_layers=p.hidden_ids,
                      exact=p.exact)
    token = select(verify.logits[:, 0], keys, s.num_tokens, sampling)
    b = token.shape[0]
    root_only = jnp.zeros((b, 1), jnp.int32)
    return _emit_round(p, s, verify, verify.cache, root_only, token[:, None], jnp.ones((b,), jnp.int32),
                       root_only[:, 0], eos_ids, limit)


def _body(p: _Parts, keys, sampling, eos_ids, limit):
    """The loop's body for `p.method`: a speculative round, or `_step` for "ar"."""
    if p.method == "ar":
        return lambda s: _step(p, s, keys, sampling, eos_ids, limit)
    return lambda s: _round(p, s, keys, sampling, eos_ids, limit)[0]


@functools.partial(jax.jit, static_argnames=("adapter_graphdef", "graphdef"))
def weaver_tables(adapter_params, params, *, adapter_graphdef, graphdef) -> Tables:
    """The adapter's two `[V, d]` tables for the target (`Adapter.tables`) as a program of their own: host code
    makes them once and every call of a stream or a server's slots takes them (at the Qwen3-8B shape they are
    ~2.5 TFLOP: ~4 ms on an H200 by its bf16 peak, estimated, not measured), `generate` too, so that its tokens
    and a stream's come from the same tables."""
    return nnx.merge(adapter_graphdef, adapter_params).tables(nnx.merge(graphdef, params))


# eos_ids and limit are traced, as `ar_generate`'s
_STATIC = ("graphdef", "drafter_graphdef", "adapter_graphdef", "method", "options", "max_new_tokens", "sampling",
           "kernels", "exact")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache", "drafter_cache"))
def spec_generate(params, drafter_params, cache: KVCache, drafter_cache: KVCache, prompts, prompt_lengths, keys,
                  adapter_params=None, tables=None, limit=None, eos_ids=(), *, graphdef, drafter_graphdef,
                  adapter_graphdef=None, method: str, options: tuple = (), max_new_tokens: int,
                  sampling: Sampling = _GREEDY, kernels: tuple[str, ...] = (), exact: bool = False) -> SpecOutput:
    """Speculative counterpart of `ar_generate` (same prompt, cache and key conventions).

    options: the static method options as a sorted tuple of (name, value) (`tree_options`). The
    target cache needs `T + max_new_tokens + N` slots, the drafter cache `T + max_new_tokens +
    block_size`. "weaver" also takes the adapter's params and graphdef, and `weaver_tables`' result (made
    inside when None). limit, eos_ids: traced, as `ar_generate`'s. kernels: the Pallas kernels to use
    (`weaver_jax.pallas_kernels.KERNELS` names). exact: the target's row-invariant forward, which makes the
    output bitwise `ar_generate(..., exact=True)`'s in any dtype. The chain inside a JAX program of your own
    (`generate` resolves the options for you):

        graphdef, params = nnx.split(bundle.target)
        drafter_graphdef, drafter_params = nnx.split(bundle.drafter)
        out = weaver_jax.spec_generate(
            params, drafter_params, bundle.target.init_cache(1, 256), bundle.drafter.init_cache(1, 256),
            prompts, prompt_lengths, weaver_jax.sequence_keys(0, 1), graphdef=graphdef,
            drafter_graphdef=drafter_graphdef, method="dflash", max_new_tokens=64,
            options=(("depth", bundle.drafter.config.block_size - 1),))
        out.tokens[0, : out.num_tokens[0]], out.rounds  # ar_generate's tokens, in fewer target passes"""
    with kernel_scope(kernels):
        p = _parts(params, drafter_params, adapter_params, graphdef, drafter_graphdef, adapter_graphdef, method,
                   options, exact, tables)
        state = _prefill(p, cache, drafter_cache, prompts, prompt_lengths, keys, sampling, eos_ids, max_new_tokens,
                         limit)
        limit = max_new_tokens if limit is None else limit
        state = jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                                   lambda s: _round(p, s, keys, sampling, eos_ids, limit)[0], state)
    return SpecOutput(state.tokens, state.num_tokens, state.rounds, state.seq_rounds, state.histogram,
                      state.cache, state.drafter_cache)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache", "drafter_cache"))
def spec_start(params, drafter_params, cache: KVCache, drafter_cache: KVCache, prompts, prompt_lengths, keys,
               adapter_params=None, tables=None, limit=None, eos_ids=(), *, graphdef, drafter_graphdef,
               adapter_graphdef=None, method: str, options: tuple = (), max_new_tokens: int,
               sampling: Sampling = _GREEDY, kernels: tuple[str, ...] = (), exact: bool = False) -> SpecState:
    """`spec_generate`'s prefill alone (same arguments): -> the state `spec_advance` continues."""
    with kernel_scope(kernels):
        p = _parts(params, drafter_params, adapter_params, graphdef, drafter_graphdef, adapter_graphdef, method,
                   options, exact, tables)
        return _prefill(p, cache, drafter_cache, prompts, prompt_lengths, keys, sampling, eos_ids, max_new_tokens,
                        limit)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "weights_tree"), donate_argnames=("state",))
def spec_advance(weights, state: SpecState, keys, halt, rounds, leave, limit=None, eos_ids=(), *, weights_tree,
                 graphdef, drafter_graphdef, adapter_graphdef=None, method: str, options: tuple = (),
                 max_new_tokens: int, sampling: Sampling = _GREEDY, kernels: tuple[str, ...] = (),
                 exact: bool = False) -> tuple[SpecState, jax.Array]:
    """Up to `rounds` (<= MAX_ROUNDS_PER_CALL, traced) more rounds of `spec_start`'s state (sequences with
    `halt [B]` set end first; with `leave` (a traced bool) the call ends once a sequence does): -> (the state, the
    tokens emitted by this call `[B, min(MAX_ROUNDS_PER_CALL x (depth + 1), max_new_tokens)]`, -1 past each one's
    count). weights, weights_tree: `weight_leaves(params, drafter_params, adapter_params, tables)`; limit,
    eos_ids: `spec_start`'s."""
    from weaver_jax._generate import MAX_ROUNDS_PER_CALL, advance

    params, drafter_params, adapter_params, tables = jax.tree.unflatten(weights_tree, weights)
    with kernel_scope(kernels):
        p = _parts(params, drafter_params, adapter_params, graphdef, drafter_graphdef, adapter_graphdef, method,
                   options, exact, tables)
        return advance(state._replace(done=state.done | halt), rounds, leave,
                       min(MAX_ROUNDS_PER_CALL * (p.depth + 1), max_new_tokens),
                       _body(p, keys, sampling, eos_ids, max_new_tokens if limit is None else limit))


@functools.partial(jax.jit, static_argnames=_STATIC)
def spec_first_round(params, drafter_params, cache: KVCache, drafter_cache: KVCache, prompts, prompt_lengths, keys,
                     adapter_params=None, tables=None, limit=None, eos_ids=(), *, graphdef, drafter_graphdef,
                     adapter_graphdef=None, method: str, options: tuple = (), max_new_tokens: int,
                     sampling: Sampling = _GREEDY, kernels: tuple[str, ...] = (),
                     exact: bool = False) -> tuple[Tree, Acceptance]:
    """The prefill and the first round of `spec_generate` (same arguments), for looking inside:
    -> (the proposal tree `[B, N]`, its acceptance: path `[B, K + 1]` of node indices, root first)."""
    with kernel_scope(kernels):
        p = _parts(params, drafter_params, adapter_params, graphdef, drafter_graphdef, adapter_graphdef, method,
                   options, exact, tables)
        state = _prefill(p, cache, drafter_cache, prompts, prompt_lengths, keys, sampling, eos_ids, max_new_tokens,
                         limit)
        _, tree, acc = _round(p, state, keys, sampling, eos_ids, max_new_tokens if limit is None else limit)
    return tree, acc
