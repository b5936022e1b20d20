"""Acceptance walk and K/V commit for a batch of trees, in place on the cache.

The walk: from the root, the target's token at the current node is `choice[cur]` (its argmax, or
its sample keyed by the generated token it is for, `_speculative.node_steps`); move to the valid
child carrying it (the lowest index if several), else it is the bonus. The commit: the K/V of the
accepted nodes (scratch slots `len + path[i]`) move to `len + i`, in every layer; slots past the
committed length are free space, so nothing is undone.

Two Pallas Triton kernels over a grid of (batch, K/V head), each program walking its sequence's
tree (a few vector ops per depth, repeated per head rather than communicated):
  1. walk + gather: path, length, bonus, and the accepted rows of every layer into small buffers;
  2. scatter: those rows into `[len, len + length)` of the caches, aliased in place
     (`input_output_aliases`), so with a donated cache XLA copies nothing.
A path's source slots can be another path row's destination (path [0, 2, 3]: row 1 reads slot 2,
which row 2 overwrites), so the reads finish in one kernel before the other writes.
`accept_commit_reference` is the same in plain JAX (the walk `_speculative.accept` uses, `commit_kv`).

Shapes: a `Tree` of `[B, N]`, choice `[B, N]` int32 (`_speculative.node_choices`), a `KVCache` of
`[B, S, H_kv, D]` layers (D a power of two >= 16) -> an `Acceptance` (path `[B, max_depth + 1]`
root first, length `[B]` incl. the root, bonus `[B]`) and the cache with rows `[len, len + length)`
committed (lengths unchanged).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from weaver_jax._model import KVCache
from weaver_jax._speculative import Acceptance, commit_kv, walk_choices
from weaver_jax._tree import Tree
from weaver_jax.pallas_kernels._call import pallas_call, pick, pow2_at_least


def accept_commit_reference(tree: Tree, choice, cache: KVCache, *, max_depth: int) -> tuple[Acceptance, KVCache]:
    """The walk over `choice` and the K/V move in plain JAX (`_speculative.walk_choices` + `commit_kv`)."""
    acc = walk_choices(tree, choice, max_depth)
    return acc, commit_kv(cache, acc.path)


def _walk(tokens_ref, parent_ref, valid_ref, choice_ref, *, steps: int, p: int):
    """Inside a kernel: the walk over one tree held as `[Np]` vectors -> path `[P]`, length, bonus."""
    tokens, parent, valid, choice = tokens_ref[...], parent_ref[...], valid_ref[...] != 0, choice_ref[...]
    n = tokens.shape[0]
    index = jnp.arange(n)
    slot = jnp.arange(p)

    def step(i, carry):
        cur, alive, path, length, bonus = carry
        y = pick(choice, index, cur)
        match = valid & (parent == cur) & (tokens == y)
        child = jnp.min(jnp.where(match, index, n))
        found = alive & (child < n)
        path = jnp.where(found & (slot == length), child, path)
        bonus = jnp.where(alive & ~found, y, bonus)
        return jnp.where(found, child, cur), found, path, length + found.astype(jnp.int32), bonus

    init = (jnp.int32(0), jnp.bool_(True), jnp.zeros((p,), jnp.int32), jnp.int32(1), jnp.int32(0))
    _, _, path, length, bonus = jax.lax.fori_loop(0, steps, step, init)
    return path, length, bonus


def _move(sources, destinations, load, store, in_flight: int):
    """store(destination, load(source)) for each pair, `in_flight` loads issued before their stores:
    as far as the compiler knows a store may alias a later load's buffer, so pair by pair would wait
    out every load's latency in turn."""
    for first in range(0, len(sources), in_flight):
        values = [load(source) for source in sources[first:first + in_flight]]
        for destination, value in zip(destinations[first:first + in_flight], values, strict=True):
            store(destination, value)


def _walk_gather_kernel(len_ref, tokens_ref, parent_ref, valid_ref, choice_ref, *refs, layers: int, steps: int,
                        p: int, in_flight: int):
    caches, (path_ref, length_ref, bonus_ref), rows = refs[:layers], refs[layers:layers + 3], refs[layers + 3:]
    path, length, bonus = _walk(tokens_ref, parent_ref, valid_ref, choice_ref, steps=steps, p=p)
    path_ref[...] = path
    length_ref[...] = length
    bonus_ref[...] = bonus
    b, h = pl.program_id(0), pl.program_id(1)
    src = len_ref[...] + path
    d = rows[0].shape[-1]
    taken = jnp.broadcast_to((jnp.arange(p) < length)[:, None], (p, d))
    index = (b, src[:, None], h, jnp.arange(d)[None, :])

    def store(out, value):
        out[...] = value

    _move(caches, rows, lambda cache: plgpu.load(cache.at[index], mask=taken, other=0), store, in_flight)


def _scatter_kernel(len_ref, length_ref, *refs, layers: int, p: int, in_flight: int):
    rows, outs = refs[:layers], refs[2 * layers:]  # refs[layers:2 * layers]: the caches, aliased to outs
    b, h = pl.program_id(0), pl.program_id(1)
    dst = len_ref[...] + jnp.arange(p)
    d = rows[0].shape[-1]
    taken = jnp.broadcast_to((jnp.arange(p) < length_ref[...])[:, None], (p, d))
    index = (b, dst[:, None], h, jnp.arange(d)[None, :])
    _move(rows, outs, lambda row: row[...], lambda out, value: plgpu.store(out.at[index], value, mask=taken),
          in_flight)


@functools.partial(jax.jit, static_argnames=("max_depth", "layers_in_flight", "num_warps", "interpret", "poison"),
                   donate_argnames=("cache",))
def accept_commit(tree: Tree, choice, cache: KVCache, *, max_depth: int, layers_in_flight: int = 8,
                  num_warps: int = 4, interpret: bool = False, poison: bool = False) -> tuple[Acceptance, KVCache]:
    """The walk and the commit in two Pallas kernels (see the module docstring); `cache` is donated.
    layers_in_flight: cache arrays whose rows are loaded before any is stored (latency overlap; 8
    with 4 warps measured walk + commit 35 us against 64 us for 1 with 1 warp, and 34 us for 24,
    BENCHMARKS.md); num_warps: Triton's, per program.
    poison (tests): the walk's outputs and row buffers start as -7 / NaN, so an element no program
    writes cannot pass."""
    tokens, parent, valid = tree.tokens, tree.parent, tree.valid
    caches, lengths = cache.k + cache.v, cache.lengths
    b, n = tokens.shape
    _, _, kv, d = caches[0].shape
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    p, n_pad = max_depth + 1, pow2_at_least(n, 2)
    p_pad = pow2_at_least(p, 2)
    pad = lambda x, fill: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, n_pad - n)), constant_values=fill)  # noqa: E731
    tree_rows = [pad(tokens, 0), pad(parent, -1), pad(valid, 0), pad(choice, 0)]
    lengths = lengths.astype(jnp.int32)
    layers = len(caches)
    scalar = pl.BlockSpec((None,), lambda i, h: (i,))
    row = pl.BlockSpec((None, n_pad), lambda i, h: (i, 0))
    whole = pl.BlockSpec()  # the full cache: rows are addressed inside the kernel
    rows_spec = pl.BlockSpec((None, p_pad, None, d), lambda i, h: (i, 0, h, 0))
    out_specs = [pl.BlockSpec((None, p_pad), lambda i, h: (i, 0)), scalar, scalar] + [rows_spec] * layers
    out_shape = ([jax.ShapeDtypeStruct((b, p_pad), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
                  jax.ShapeDtypeStruct((b,), jnp.int32)]
                 + [jax.ShapeDtypeStruct((b, p_pad, kv, d), c.dtype) for c in caches])
    launch = dict(grid=(b, kv), num_warps=num_warps, num_stages=1, interpret=interpret)
    path, length, bonus, *rows = pallas_call(
        functools.partial(_walk_gather_kernel, layers=layers, steps=p, p=p_pad, in_flight=layers_in_flight),
        [lengths, *tree_rows, *caches],
        in_specs=[scalar, row, row, row, row] + [whole] * layers, out_specs=out_specs, out_shape=out_shape,
        name="accept_walk_gather", poison=poison, **launch)
    caches = pallas_call(
        functools.partial(_scatter_kernel, layers=layers, p=p_pad, in_flight=layers_in_flight),
        [lengths, length, *rows, *caches],
        in_specs=[scalar, scalar] + [rows_spec] * layers + [whole] * layers, out_specs=[whole] * layers,
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        aliases={2 + layers + i: i for i in range(layers)}, name="accept_commit_scatter", **launch)
    half = len(cache.k)
    # replace, not a new KVCache: a hybrid target's cache keeps its GDN states
    return Acceptance(path[:, :p], length, bonus), dataclasses.replace(cache, k=tuple(caches[:half]),
                                                                       v=tuple(caches[half:]))
