"""Autoregressive generation as one jitted function, and the `generate` entry point.

`ar_generate` is the pure function JAX programs call: prefill of right-padded ragged prompts,
then a `lax.while_loop` of one-token decode steps with the cache donated. `generate` is the thin
host wrapper: validation, padding, compilation cache and timing.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import time
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from weaver_jax._model import KVCache, fresh_cache
from weaver_jax._sampling import Sampling, select
from weaver_jax.pallas_kernels import enabled_kernels, kernel_scope

_GREEDY = Sampling()


class ARState(NamedTuple):
    step: jax.Array  # scalar int32: tokens emitted so far by the longest-running sequence
    last: jax.Array  # [B] int32: last emitted token (not yet in the cache)
    cache: KVCache
    tokens: jax.Array  # [B, max_new_tokens] int32, -1 past each sequence's end (max_new_tokens: the buffer's width)
    num_tokens: jax.Array  # [B] int32
    done: jax.Array  # [B] bool


class AROutput(NamedTuple):
    """`ar_generate`'s result (arrays on the device): tokens `[B, max_new_tokens]` (-1 past num_tokens `[B]`), the
    target's passes, the last token `[B]` (not yet in the cache) and the committed cache:

        out = weaver_jax.ar_generate(params, cache, prompts, prompt_lengths, keys, graphdef=graphdef, max_new_tokens=64)
        out.tokens[0, : out.num_tokens[0]], out.cache.lengths
    """

    tokens: jax.Array  # [B, max_new_tokens] int32, -1 past num_tokens
    num_tokens: jax.Array  # [B] int32 (EOS included when hit)
    rounds: jax.Array  # scalar int32: target forward passes that emitted tokens (prefill included)
    last: jax.Array  # [B] last emitted token, not yet written to the cache
    cache: KVCache  # committed: prompt + all emitted tokens but the last


def is_eos(tokens: jax.Array, eos_ids) -> jax.Array:
    """Which of `tokens` are among `eos_ids` (ids: a tuple, or an int32 array, traced or not; -1 pads it)."""
    eos = jnp.asarray(eos_ids, jnp.int32).reshape(-1)
    return jnp.isin(tokens, eos) if eos.size else jnp.zeros(jnp.shape(tokens), bool)


def _emit(state: ARState, token: jax.Array, active: jax.Array, eos_ids, limit) -> ARState:
    """Write each active sequence's `token`; it is done at an EOS id or at `limit` tokens (<= the buffer's width)."""
    col = jnp.where(active, state.num_tokens, state.tokens.shape[1])  # out of range: dropped
    tokens = state.tokens.at[jnp.arange(token.shape[0]), col].set(token, mode="drop")
    num_tokens = state.num_tokens + active
    done = state.done | (active & is_eos(token, eos_ids)) | (num_tokens >= limit)
    last = jnp.where(active, token, state.last)
    return state._replace(last=last, tokens=tokens, num_tokens=num_tokens, done=done)


# eos_ids and limit are traced (not static): a program serves every EOS set of one length and every limit up to
# its buffer's width (`generate` pads the one and rounds the other up: `eos_array`, `token_buffer`)
_AR_STATIC = ("graphdef", "max_new_tokens", "sampling", "kernels", "exact")


def token_buffer(max_new_tokens: int) -> int:
    """The width of the tokens buffer `generate` gives a call of `max_new_tokens` (passed as its traced `limit`):
    the power of two that holds them, at least 32, so that calls of nearby lengths share one compiled program."""
    return max(32, 1 << (int(max_new_tokens) - 1).bit_length())


def eos_array(eos_ids: Sequence[int]) -> np.ndarray:
    """EOS ids as the traced `eos_ids` argument `generate` passes: int32, padded with -1 (no token) to a power of two,
    at least 4, so that EOS sets of nearby sizes (none included) share one compiled program."""
    out = np.full(max(4, 1 << max(len(eos_ids) - 1, 0).bit_length()), -1, np.int32)
    out[: len(eos_ids)] = eos_ids
    return out


def _limit(limit, max_new_tokens: int):
    return max_new_tokens if limit is None else limit


@functools.partial(jax.jit, static_argnames=_AR_STATIC, donate_argnames=("cache",))
def ar_generate(
    params: nnx.State,
    cache: KVCache,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    keys: jax.Array,
    limit: jax.Array | int | None = None,
    eos_ids: Sequence[int] | jax.Array = (),
    *,
    graphdef: nnx.GraphDef,
    max_new_tokens: int,
    sampling: Sampling = _GREEDY,
    kernels: tuple[str, ...] = (),
    exact: bool = False,
) -> AROutput:
    """Prefill `prompts [B, T]` (right-padded; real lengths `prompt_lengths [B]`) after whatever
    `cache` already holds, then decode up to `max_new_tokens` per sequence.

    graphdef, params = `nnx.split(target)`. keys `[B]`: one PRNG key per sequence.
    The cache needs `cache.lengths + T` and `cache.lengths + prompt_lengths + max_new_tokens`
    slots; it is donated. eos_ids (traced: a program per their count): ids that end a sequence, -1 for none.
    limit (traced, default max_new_tokens): at most this many tokens per sequence, max_new_tokens then only the
    tokens buffer's width (`generate` passes `token_buffer(n)` and n: nearby lengths share a program); the cache
    needs room for `limit` tokens (not checked). kernels: the Pallas kernels to use (names). exact: the target's
    row-invariant forward (`Transformer.__call__`), whose tokens every speculative method reproduces
    bitwise with `exact=True` (on a GPU, in a program compiled as `generate` compiles it: `exact_jit`).
    Inside a JAX program of your own (`generate` is the host wrapper around it):

        graphdef, params = nnx.split(bundle.target)
        prompts = jnp.asarray([ids + [0] * (32 - len(ids))])             # [1, 32], right-padded
        out = weaver_jax.ar_generate(params, bundle.target.init_cache(1, 256), prompts, jnp.asarray([len(ids)]),
                                     weaver_jax.sequence_keys(0, 1), graphdef=graphdef, max_new_tokens=64)
        out.tokens[0, : out.num_tokens[0]]                                # out.cache continues the sequence
    """
    with kernel_scope(kernels):
        return _ar_generate(params, cache, prompts, prompt_lengths, keys, graphdef, max_new_tokens, sampling, eos_ids,
                            exact, limit)


def _ar_generate(params, cache, prompts, prompt_lengths, keys, graphdef, max_new_tokens, sampling, eos_ids, exact,
                 limit=None):
    model = nnx.merge(graphdef, params)
    state = _ar_start(model, cache, prompts, prompt_lengths, keys, max_new_tokens, sampling, eos_ids, exact, limit)
    limit = _limit(limit, max_new_tokens)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                               lambda s: _ar_step(model, s, keys, limit, sampling, eos_ids, exact), state)
    return AROutput(state.tokens, state.num_tokens, state.step, state.last, state.cache)


def _ar_start(model, cache, prompts, prompt_lengths, keys, max_new_tokens, sampling, eos_ids, exact,
              limit=None) -> ARState:
    """The prefill and the first token (max_new_tokens: the tokens buffer's width; limit: see `ar_generate`)."""
    b, t = prompts.shape
    # necessary even for an empty cache; slots would be clamped (a traced limit: the caller checks)
    if limit is None and t + max_new_tokens > cache.size:
        raise ValueError(f"cache of {cache.size} slots cannot hold prompts of {t} + {max_new_tokens} new tokens")
    out = model.prefill(prompts, cache, prompt_lengths, logits_rows=(prompt_lengths - 1)[:, None], exact=exact)
    state = ARState(
        step=jnp.int32(1), last=jnp.zeros((b,), jnp.int32), cache=out.cache,
        tokens=jnp.full((b, max_new_tokens), -1, jnp.int32),
        num_tokens=jnp.zeros((b,), jnp.int32), done=jnp.zeros((b,), bool))
    first = select(out.logits[:, 0], keys, jnp.int32(0), sampling)
    return _emit(state, first, jnp.ones((b,), bool), eos_ids, _limit(limit, max_new_tokens))


def _ar_step(model, s: ARState, keys, limit, sampling, eos_ids, exact) -> ARState:
    """One decode step of the sequences not done (limit: the most tokens a sequence emits)."""
    active = ~s.done
    o = model(s.last[:, None], s.cache.lengths[:, None], s.cache, exact=exact)
    cache = model.commit(o.cache, o.pending, jnp.zeros((s.last.shape[0], 1), jnp.int32), active.astype(jnp.int32))
    token = select(o.logits[:, 0], keys, s.num_tokens, sampling)  # per sequence: a batch's rows may start apart
    s = s._replace(step=s.step + 1, cache=cache)
    return _emit(s, token, active, eos_ids, limit)


@functools.partial(jax.jit, static_argnames=_AR_STATIC, donate_argnames=("cache",))
def ar_start(params, cache, prompts, prompt_lengths, keys, limit=None, eos_ids=(), *, graphdef, max_new_tokens,
             sampling=_GREEDY, kernels=(), exact=False) -> ARState:
    """`ar_generate`'s prefill alone (same arguments): -> the state `ar_advance` continues."""
    with kernel_scope(kernels):
        return _ar_start(nnx.merge(graphdef, params), cache, prompts, prompt_lengths, keys, max_new_tokens, sampling,
                         eos_ids, exact, limit)


MAX_ROUNDS_PER_CALL = 64  # the most rounds (decode steps for "ar") a streaming call runs: its window's width


def weight_leaves(*states) -> tuple[list[jax.Array], jax.treedef]:
    """A model's weights (nnx states) as the flat list of arrays a streaming call takes, and their treedef (static):
    calling a compiled program checks an nnx state's tree each time, ~1.3 ms a call at SmolLM2's 30 layers against
    ~0.1 ms for a list of its arrays (measured on a CPU; an H200's call cost 1.5 ms besides its rounds)."""
    return jax.tree.flatten(states)


@functools.partial(jax.jit, static_argnames=(*_AR_STATIC, "weights_tree"), donate_argnames=("state",))
def ar_advance(weights, state: ARState, keys, halt, steps, leave, limit=None, eos_ids=(), *, weights_tree, graphdef,
               max_new_tokens, sampling=_GREEDY, kernels=(), exact=False) -> tuple[ARState, jax.Array]:
    """Up to `steps` (<= MAX_ROUNDS_PER_CALL, traced) more decode steps of `ar_start`'s state (sequences with
    `halt [B]` set end first; with `leave` (a traced bool) the call ends once a sequence does): -> (the state,
    the tokens this call emitted `[B, min(MAX_ROUNDS_PER_CALL, max_new_tokens)]`, -1 past each sequence's
    count). weights, weights_tree: `weight_leaves(params)`; limit, eos_ids: `ar_start`'s."""
    (params,) = jax.tree.unflatten(weights_tree, weights)
    model = nnx.merge(graphdef, params)
    with kernel_scope(kernels):
        return advance(state._replace(done=state.done | halt), steps, leave, min(MAX_ROUNDS_PER_CALL, max_new_tokens),
                       lambda s: _ar_step(model, s, keys, _limit(limit, max_new_tokens), sampling, eos_ids,
                                          exact))


def advance(state, iterations, leave, width: int, body):
    """`body` on `state` (a NamedTuple with `tokens [B, T]`, `num_tokens [B]`, `done [B]`) until every sequence
    is done, `iterations` (traced) times, or with `leave` (traced) once a sequence ends (a server's queued
    request takes its row a call sooner): -> (state, the tokens it emitted `[B, width]`, -1 past each one's
    count; width >= what `iterations` can emit)."""
    running = ~state.done

    def cond(carry):
        i, s = carry
        return (i < iterations) & ~jnp.all(s.done) & ~(leave & jnp.any(s.done & running))

    before = state.num_tokens
    _, state = jax.lax.while_loop(cond, lambda carry: (carry[0] + 1, body(carry[1])), (jnp.int32(0), state))
    padded = jnp.pad(state.tokens, ((0, 0), (0, width)), constant_values=-1)
    window = jax.vmap(lambda row, i: jax.lax.dynamic_slice(row, (i,), (width,)))(padded, before)
    return state, window


def sequence_keys(seed: int | Sequence[int], batch: int) -> jax.Array:
    """One PRNG key per sequence `[batch]`: `fold_in(key(seed), i)` for an int seed, `key(seed[i])` for a list;
    generated token t of sequence i is drawn with `fold_in(keys[i], t)` in every method.

        keys = weaver_jax.sequence_keys(0, 4)       # what generate(..., seed=0) uses for 4 prompts
    """
    if isinstance(seed, (int, np.integer)):
        if -(2**31) <= seed < 2**31:  # one compiled program (a streaming call's start pays no tracing)
            return _folded_keys_jit(int(seed), batch)
        return _folded_keys(int(seed), batch)  # a 64-bit seed: eagerly, as jax.random.key takes it
    if len(seed) != batch:
        raise ValueError(f"got {len(seed)} seeds for {batch} prompts")
    return _listed_keys(jnp.asarray(seed, jnp.uint32))


def _folded_keys(seed, batch: int) -> jax.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), jnp.arange(batch))


_folded_keys_jit = jax.jit(_folded_keys, static_argnums=1)
_listed_keys = jax.jit(jax.vmap(jax.random.key))


@dataclasses.dataclass
class GenerateResult:
    """What `generate` returns: `tokens` per prompt (lists of ids, EOS included when hit) and `stats`
    (`generate`'s docstring lists the keys):

        out = weaver_jax.generate(bundle, [ids], max_new_tokens=64, method="weaver")
        out.tokens[0], out.stats["tokens_per_second"], out.stats["mean_accepted_length"]
    """

    tokens: list[list[int]]  # generated ids per prompt, EOS included when hit, nothing after it
    stats: dict


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def validate_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise ValueError(f"prompt {i} must be a list of token ids (encode text with bundle.tokenizer)")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        ids = np.asarray(p)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt {i} holds non-integer ids")
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5].tolist()}")
        out.append([int(x) for x in ids])
    return out


def _eos_ids(eos_token_id, default: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    if eos_token_id is None:
        return tuple(default)
    ids = (eos_token_id,) if isinstance(eos_token_id, (int, np.integer)) else tuple(eos_token_id)
    for e in ids:
        if not 0 <= int(e) < vocab_size:
            raise ValueError(f"eos_token_id {e} is outside the vocabulary [0, {vocab_size})")
    return tuple(sorted(int(e) for e in ids))


# Compiled programs, least recently used first. Bounded: each program holds its executable (on a CPU a few hundred
# memory maps of its own, and Linux stops a process at vm.max_map_count, 65530 by default: a long-lived process
# compiling many shapes crashed inside XLA's compile), and one evicted is compiled again when next used.
MAX_COMPILED = 128
_COMPILED: collections.OrderedDict = collections.OrderedDict()
# The latest compiles' phases: (function name, perf_counter at the start of tracing, of lowering, of XLA's compile,
# at its end). Tracing and lowering run Python under the GIL, so programs compiled at once (`weaver-jax tune`'s
# cells) wait on each other there (bench/tune_split.py)
COMPILE_PHASES: collections.deque = collections.deque(maxlen=256)
# XLA options on top of its defaults, per program: "ar" (plain decoding) and "spec" (a speculative method's loop).
# A flag applies to a whole program, so a setting that helps a round's verification is given to that program
# only; bench/round_profile.py --spec-compiler-options measures candidates.
COMPILER_OPTIONS: dict[str, dict] = {"ar": {}, "spec": {}}
# Exact mode's programs compile with XLA's excess precision off. By default XLA may skip rounding a value to
# bfloat16 where a fused operation reads it straight back in float32 (a product's bfloat16 output read by a norm,
# a GDN layer's conv), and whether it does depends on what it fused, which differs between a tree, a decode step
# and a prefill: on the H100 a hybrid target's exact tree logits were off its prefill's in every element, found
# at the gated attention's k norm and the GDN conv (bench/exact_probe.py); with this option, bitwise. A JAX
# program of your own that runs exact forwards needs it too (`exact_jit`).
EXACT_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def exact_jit(fn, **jit_options):
    """`jax.jit(fn, **jit_options)` compiled as exact mode needs (`EXACT_COMPILER_OPTIONS`: XLA's excess precision
    off, so every bfloat16 rounding the model asks for happens whatever XLA fuses), for a program of your own that
    calls `ar_generate`, `spec_generate` or a target's forward with `exact=True` (`generate` does this itself):

        run = weaver_jax.exact_jit(weaver_jax.ar_generate, static_argnames=("graphdef", "max_new_tokens", "exact"))
        out = run(params, cache, prompts, lengths, keys, graphdef=graphdef, max_new_tokens=64, exact=True)"""
    options = jit_options.pop("compiler_options", None) or {}
    return jax.jit(fn, compiler_options={**EXACT_COMPILER_OPTIONS, **options}, **jit_options)


# Command buffers (CUDA graphs) for the streaming calls' loops too: XLA's default runs a while loop from the host,
# which reads the loop's condition after every round, so a call returned only once its loop had ended; as a
# command buffer the loop runs on the GPU and the call returns once queued, and a stream sends its next call
# before reading the last (measured on an H200, random target of SmolLM2's shape: a 16-round call returns in 1.7
# ms instead of 17.4; a sequence in calls of 16 rounds takes 0.98x generate's time for ar, 0.99x for Weaver,
# against 1.11x / 1.10x read one by one). XLA's default list plus WHILE and CONDITIONAL; not when XLA_FLAGS sets
# the list.
ASYNC_LOOP = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,"
                                                "CONDITIONAL"}


def _compiled(fn, static: dict, *args):
    """AOT-compile `fn` once per static configuration, argument shapes and shardings (a bundle on a mesh
    compiles its own program) and `COMPILER_OPTIONS` (with `EXACT_COMPILER_OPTIONS` in exact mode), so timing
    excludes it."""
    options = COMPILER_OPTIONS["ar" if fn in (ar_generate, ar_start, ar_advance) else "spec"]
    if static.get("exact"):
        options = EXACT_COMPILER_OPTIONS | options
    from weaver_jax._speculative import spec_advance

    if fn in (ar_advance, spec_advance) and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        options = ASYNC_LOOP | options
    leaves, treedef = jax.tree.flatten(args)  # not str() of the tree: nnx's repr of a model's state takes ~10 ms
    shapes = treedef, tuple((a.shape, a.dtype, getattr(a, "sharding", None)) for a in leaves)
    key = (fn, tuple(sorted((k, _prehashed(v)) for k, v in static.items())), shapes, tuple(sorted(options.items())))
    if key not in _COMPILED:
        t0 = time.perf_counter()
        traced = fn.trace(*args, **static)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        _COMPILED[key] = lowered.compile(compiler_options=options or None)
        COMPILE_PHASES.append((fn.__name__, t0, t1, t2, time.perf_counter()))
        while len(_COMPILED) > MAX_COMPILED:
            _COMPILED.popitem(last=False)
    else:
        _COMPILED.move_to_end(key)
    return _COMPILED[key]


class _Prehashed:
    """A static argument hashed once: hashing an nnx GraphDef walks the model's whole graph (~1 ms a model at
    SmolLM2's 30 layers on a CPU), which every program lookup of a stream or a `generate` call paid."""

    __slots__ = ("value", "hash")

    def __init__(self, value):
        self.value, self.hash = value, hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _Prehashed) and (self.value is other.value or self.value == other.value)


_HASHED: dict[int, _Prehashed] = {}  # id(graphdef) -> the graphdef and its hash (`split` returns one per model)


def _prehashed(value):
    if not isinstance(value, nnx.GraphDef):
        return value
    found = _HASHED.get(id(value))
    if found is None or found.value is not value:
        if len(_HASHED) > 1024:  # graphdefs of models long gone (the program cache keeps its keys' own)
            _HASHED.clear()
        found = _HASHED[id(value)] = _Prehashed(value)
    return found


def target_parameters(params) -> int:
    """The values in a target's split state (`nnx.split(target)[1]`): what the default tree budget reads."""
    return sum(x.size for x in jax.tree.leaves(params))


def _speculative_setup(bundle, method: str, method_options: dict, sampled: bool, batch: int, parameters: int):
    """Check the drafter against the target and the method's options (their defaults for sampled
    decoding when `sampled`, and for this batch size and the target's `target_parameters`); -> (options,
    tree nodes)."""
    from weaver_jax._speculative import tree_options

    if bundle.drafter is None:
        raise ValueError(f"method {method!r} needs a drafter, but bundle.drafter is None "
                         "(load a bundle with a drafter, or use method='ar')")
    dconfig = bundle.drafter.config
    dconfig.check_target(bundle.target.config)
    adapter_limits = {}
    if method == "weaver":
        if bundle.adapter is None:
            raise ValueError("method 'weaver' needs an adapter, but bundle.adapter is None "
                             "(load a bundle with an adapter, or use method='ddtree')")
        bundle.adapter.config.check_target(bundle.target.config)
        adapter_limits = dict(pool_size=min(bundle.adapter.config.candidate_pool_size, dconfig.vocab_size),
                              max_depth=bundle.adapter.config.K)
    options = tree_options(method, method_options, block_size=dconfig.block_size, vocab_size=dconfig.vocab_size,
                           sampled=sampled, batch=batch, target_parameters=parameters, **adapter_limits)
    nodes = options["budget"] + 1 if "budget" in options else options["depth"] + 1
    return options, nodes


def _mesh_scope(bundle):
    """Where a sharded bundle's programs are traced: under its mesh, which the Pallas kernels read to run per
    device (`pallas_kernels._call.per_shard`)."""
    return contextlib.nullcontext() if bundle.mesh is None else jax.set_mesh(bundle.mesh)


def _on_mesh(mesh, x):
    """A cache or a per-sequence input `[B, ...]` placed over a bundle's mesh (as it is without one)."""
    if mesh is None:
        return x
    from weaver_jax._sharding import batch_sharding, cache_sharding

    return jax.device_put(x, cache_sharding(mesh, x) if isinstance(x, KVCache) else batch_sharding(mesh, np.ndim(x)))


_SPLITS: dict = {}  # id(model) -> (a weak reference to it, its pytree structure, graphdef, the state's treedef)


def split(model) -> tuple[nnx.GraphDef, nnx.State]:
    """`nnx.split(model)`: its graph walked once per model, then the state rebuilt from the model's arrays as long as
    its pytree structure (static attributes included) is the same - a walk costs ~4 ms a model at SmolLM2's 30
    layers on a CPU, paid per model by every `generate` and stream; listing the arrays ~0.5 ms. Weights replaced
    (training, `nnx.update`) are read afresh; no array is held here."""
    leaves, structure = jax.tree.flatten(model)
    made = _SPLITS.get(id(model))
    if made is not None and made[0]() is model and made[1] == structure:
        return made[2], jax.tree.unflatten(made[3], leaves)
    graphdef, state = nnx.split(model)
    state_leaves, state_tree = jax.tree.flatten(state)
    if len(state_leaves) == len(leaves) and all(a is b for a, b in zip(state_leaves, leaves, strict=True)):
        key = id(model)
        _SPLITS[key] = (weakref.ref(model, lambda _: _SPLITS.pop(key, None)), structure, graphdef, state_tree)
    return graphdef, state


def split_models(bundle, method: str) -> dict:
    """What `_prepare` takes from the bundle's models for `method`: `nnx.split` by role ("target", "drafter",
    "adapter", through `split`) and Weaver's "tables" (`weaver_tables`). Host code that prepares many batches of
    one bundle (`Slots`) makes them once: the tables are a product over the vocabulary (~2.5 TFLOP at the
    Qwen3-8B shape), and even a kept split lists the model's arrays (~1 ms at SmolLM2's shape on a CPU)."""
    return _split_models(bundle, method, {})


def _split_models(bundle, method: str, made: dict) -> dict:
    roles = {"ar": ("target",), "weaver": ("target", "drafter", "adapter")}.get(method, ("target", "drafter"))
    made = made | {role: split(getattr(bundle, role)) for role in roles if role not in made}
    if method == "weaver" and "tables" not in made:
        made["tables"] = _tables(bundle, made["target"], made["adapter"])
    return made


_TABLES: dict = {}  # (id(adapter), id(target)) -> (weak references to the arrays they were made from, tables)


def _tables(bundle, target_split, adapter_split):
    """`weaver_tables` for the bundle's adapter and target, made again only when their arrays change (a call costs a
    program's dispatch and two graph hashes besides the product: ~3 ms a stream at SmolLM2's shape on a CPU)."""
    from weaver_jax._speculative import weaver_tables

    (graphdef, params), (adapter_graphdef, adapter_params) = target_split, adapter_split
    leaves = jax.tree.leaves((params, adapter_params))
    key = (id(bundle.adapter), id(bundle.target))
    made = _TABLES.get(key)
    if made is not None and len(made[1]) == len(leaves) and all(r() is x for r, x in zip(made[1], leaves, strict=True)):
        return made[2]
    with _mesh_scope(bundle):
        tables = weaver_tables(adapter_params, params, adapter_graphdef=adapter_graphdef, graphdef=graphdef)
    forget = lambda _: _TABLES.pop(key, None)  # noqa: E731
    _TABLES[key] = ((weakref.ref(bundle.adapter, forget), weakref.ref(bundle.target, forget)),
                    [weakref.ref(x) for x in leaves], tables)
    return tables


def _prepare(bundle, prompts, method, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
             method_options, round_only=False, pad_to=None, exact=False, caches=None, cache_size=None, splits=None,
             nodes=None):
    """Validation, padding and the jitted function's arguments: -> (fn, static, args), args ending with the traced
    limit and EOS ids (`generate_limits`; static["max_new_tokens"] is the tokens buffer's width). caches: the target's
    (and for a speculative method the drafter's) to prefill after what they hold, instead of fresh ones;
    cache_size: fresh caches of that many slots (rows that join a batch with caches of that size: `Slots`);
    splits: `split_models(bundle, method)` made before; nodes: room for trees this large instead of the method's
    (method="auto": its largest tier's)."""
    from weaver_jax._speculative import METHODS, spec_first_round, spec_generate

    if method not in ("ar", *METHODS):
        raise ValueError(f"unknown method {method!r}; available: {['ar', *METHODS]}")
    if method == "ar" and method_options:
        raise TypeError(f"method 'ar' takes no options, got {sorted(method_options)}")
    config = bundle.target.config
    prompts = validate_prompts(prompts, config.vocab_size)
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(exact, bool):
        raise ValueError(f"exact must be True or False, got {exact!r}")
    sampling = Sampling(float(temperature), top_k, float(top_p))
    eos_ids = _eos_ids(eos_token_id, bundle.eos_token_ids, config.vocab_size)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > config.max_seq_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {config.max_seq_len} tokens")
    graphdef, params = splits["target"] if splits else split(bundle.target)
    if method != "ar":
        options, own_nodes = _speculative_setup(bundle, method, method_options, not sampling.greedy, len(prompts),
                                                target_parameters(params))
        nodes = max(nodes or 0, own_nodes)

    if pad_to is None:
        padded_len = _round_up(longest, 32)
    elif isinstance(pad_to, (int, np.integer)) and not isinstance(pad_to, bool) and pad_to >= longest:
        padded_len = int(pad_to)
    else:
        raise ValueError(f"pad_to must be an integer >= the longest prompt ({longest} tokens), got {pad_to!r}")
    keys = sequence_keys(seed, len(prompts))
    if bundle.mesh is not None:  # a batch split over `data`: filled up with copies of the first sequence, key
        # included, which end when it ends (so the loop runs no longer); `generate` drops them
        extra = -len(prompts) % bundle.mesh.shape["data"]
        prompts, keys = prompts + [prompts[0]] * extra, jnp.concatenate([keys, jnp.repeat(keys[:1], extra)])
    batch = np.zeros((len(prompts), padded_len), np.int32)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    # the limit and the EOS ids traced, the buffer bucketed: nearby lengths and EOS sets share a program
    static = dict(graphdef=graphdef, max_new_tokens=token_buffer(max_new_tokens), sampling=sampling,
                  kernels=enabled_kernels(), exact=exact)
    placed = functools.partial(_on_mesh, bundle.mesh)
    # each cache's slots past what it holds: the prompt, the new tokens and a tree (the drafter's: a block)
    needed = [(bundle.target, padded_len + max_new_tokens)] if method == "ar" else [
        (bundle.target, padded_len + max_new_tokens + nodes),
        (bundle.drafter, padded_len + max_new_tokens + bundle.drafter.config.block_size)]
    sizes = [_round_up(n, 128) for _, n in needed]
    if cache_size is not None:
        if max(n for _, n in needed) > cache_size:
            raise ValueError(f"caches of {cache_size} slots cannot hold prompts of {padded_len} tokens, "
                             f"{max_new_tokens} new ones and a tree")
        sizes = [cache_size] * len(needed)
    if caches is None:
        caches = [placed(fresh_cache(m, len(prompts), size)) for (m, _), size in zip(needed, sizes, strict=True)]
    else:  # a conversation's: prefilled after what they already hold
        for cache, size in zip(caches, sizes, strict=True):
            used = int(np.max(cache.lengths))
            if used + size > cache.size:
                raise ValueError(f"a cache of {cache.size} slots holding {used} has no room for the {size} "
                                 "this call needs")
        caches = list(caches)
    if method == "ar":
        fn, args = ar_generate, [params, *caches]
    else:
        splits = _split_models(bundle, method, splits or {"target": (graphdef, params)})
        drafter_graphdef, drafter_params = splits["drafter"]
        static.update(drafter_graphdef=drafter_graphdef, method=method, options=tuple(sorted(options.items())))
        fn = spec_first_round if round_only else spec_generate
        args = [params, drafter_params, *caches]
    args += [placed(a) for a in (batch, lengths, keys)]
    if method == "weaver":
        adapter_graphdef, adapter_params = splits["adapter"]
        static.update(adapter_graphdef=adapter_graphdef)
        args += [adapter_params, splits["tables"]]
    elif method != "ar":
        args += [None, None]
    return fn, static, args + [np.int32(max_new_tokens), eos_array(eos_ids)]


def generate_limits(args: list) -> tuple[int, tuple[int, ...]]:
    """The max_new_tokens and EOS ids among `_prepare`'s `args` (its last two)."""
    limit, eos = args[-2:]
    return int(limit), tuple(int(e) for e in np.asarray(eos) if e >= 0)


def generate(bundle, prompts, *, method: str = "ar", max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | Sequence[int] = 0,
             eos_token_id: int | Sequence[int] | None = None, pad_to: int | None = None, exact: bool = False,
             stop: str | Sequence[str] | None = None, **method_options) -> GenerateResult:
    """Generate continuations of `prompts` with `bundle.target`, by plain decoding or a speculative method.

        bundle = weaver_jax.load("smollm2-135m-instruct")
        ids = bundle.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
        out = weaver_jax.generate(bundle, [ids], method="weaver", max_new_tokens=64)
        out.tokens[0], out.stats["tokens_per_second"], out.stats["mean_accepted_length"]

    prompts: B lists of token ids, any lengths (right-padded inside to `pad_to`, default the longest rounded up
        to 32: calls with the same batch size, pad_to and options share one compilation).
    method: "ar" (plain decoding), "dflash" (the drafter's argmax chain), "ddtree" (the best `budget` prefixes
        of the drafter's marginals), "weaver" (the adapter's best-first tree) or "auto" (chosen per call from
        this device's measured round times and adapted as acceptance changes: `weaver_jax._auto`). Every method
        emits what "ar" emits: greedy tokens equal, sampled tokens the same for a seed - up to a near-tie's
        rounding in bfloat16, none with `exact=True`.
    max_new_tokens: per prompt, EOS included when hit (a traced limit: calls of up to the same power of two, at
        least 32, share a compiled program, and so do EOS sets of up to 4 ids).
    temperature, top_k, top_p: sampling filters (temperature 0: greedy).
    seed: an int (sequence i draws from `fold_in(key(seed), i)`) or one seed per prompt; generated token t of a
        sequence is drawn with `fold_in(its key, t)` in every method.
    eos_token_id: None: the bundle's EOS ids; an id or ids; `[]` disables EOS.
    stop: a string or strings (needs the bundle's tokenizer): a sequence ends with the token that completes the
        first one in its text (the rounds then run a few per call, `weaver_jax.stream`'s loop).
    exact: the target's row-invariant forward: a token's numbers do not depend on what is computed with it, so
        every method is bitwise "ar"'s in any dtype, at some cost in speed (BENCHMARKS.md).
    method options (`**method_options`):
        every speculative method: `depth`, the deepest tree level (default and maximum: the drafter's block size
            - 1, and the adapter's K for "weaver").
        "ddtree": `budget` (64; for targets of >= 1B parameters 31 at batch 1-2, else 15).
        "weaver": `budget` (24; >= 1B parameters: 63 at batch 1-2, 31 at 3-4, else 15), `children_per_node` (8),
            `root_children` (children_per_node; when sampling budget // 2, within [children_per_node,
            pool_size]), `expansions_per_call` (min(8, ceil(budget / 3))), `pool_size` (64, at most the
            adapter's), `marginal_tail` (min(8, budget // 6): nodes continuing the deepest one along the
            drafter's argmax; 0: none).
        "auto": `tiers` (method names or dicts of a method and its options), `remeasure` (time the tiers again).
    Returns a `GenerateResult`: `.tokens` (per prompt) and `.stats`: `rounds`, `tokens_per_second`, `seconds`,
    `compile_seconds`, `new_tokens`, `finish_reasons` ("stop": EOS or a stop string, or "length"); speculative
    methods add `mean_accepted_length` (τ: tokens per verification, bonus included), `accepted_length_histogram`,
    `options` (as run, defaults filled in), `sequence_verifications` and `sequence_accepted_tokens` per prompt;
    "auto" adds `settings` (its tiers, the switches and the call each happened at, rounds per tier).
    """
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   eos_token_id=eos_token_id, pad_to=pad_to, exact=exact)
    plan = None
    if method == "auto":
        from weaver_jax._auto import Plan

        prompts = validate_prompts(prompts, bundle.target.config.vocab_size)
        plan = Plan(bundle, prompts, temperature, exact, method_options, lockstep=len(prompts) > 1)
        if plan.loop_tiers is None and stop is None:  # plain decoding predicted fastest: its whole-call program
            result = generate(bundle, prompts, method="ar", **options)
            result.stats["settings"] = plan.settings()
            return result
    if stop is not None or method == "auto":  # rounds a few at a time, read as they come: the text decides where
        # a sequence ends, or the tier of the next call is chosen from the last ones' acceptance
        from weaver_jax._stream import generate_chunked

        return generate_chunked(bundle, prompts, stop=stop, method=method, plan=plan, **options, **method_options)
    fn, static, args = _prepare(bundle, prompts, method, max_new_tokens, temperature, top_k, top_p, seed,
                                eos_token_id, method_options, pad_to=pad_to, exact=exact)
    t0 = time.perf_counter()
    with _mesh_scope(bundle):
        compiled = _compiled(fn, static, *args)
    t1 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    seconds = time.perf_counter() - t1

    real = len(prompts)  # a sharded bundle's batch may hold copies past them
    counts = np.asarray(out.num_tokens)[:real]
    tokens = np.asarray(out.tokens)[:real]
    tokens = [tokens[i, : counts[i]].tolist() for i in range(len(counts))]
    reasons = [finish_reason(t, generate_limits(args)[1], max_new_tokens) for t in tokens]
    return GenerateResult(tokens, run_stats(out, method, tokens, seconds, t1 - t0, static, real, reasons))


def finish_reason(tokens: list[int], eos_ids, max_new_tokens: int, stopped: bool = False) -> str:
    """OpenAI's: "stop" for EOS or a stop string, "length" at max_new_tokens."""
    if stopped or (tokens and tokens[-1] in eos_ids):
        return "stop"
    return "length" if len(tokens) >= max_new_tokens else "stop"


def run_stats(out, method: str, tokens: list[list[int]], seconds: float, compile_seconds: float, static: dict,
              real: int, finish_reasons: list[str]) -> dict:
    """`generate`'s stats from the loop's final state or output (`real`: the caller's sequences of its batch)."""
    new_tokens = sum(len(t) for t in tokens)
    rounds = int(out.rounds if hasattr(out, "rounds") else out.step)
    stats = dict(rounds=rounds, new_tokens=new_tokens, seconds=seconds, tokens_per_second=new_tokens / seconds,
                 compile_seconds=compile_seconds, finish_reasons=finish_reasons)
    if method != "ar":
        per_sequence = np.asarray(out.histogram)[:real]  # [B, K + 2]: rounds by tokens emitted
        histogram = per_sequence.sum(0)
        verifications = int(np.asarray(out.seq_rounds)[:real].sum())
        # per prompt, so that tau can be pooled over any subset of a batch
        stats["sequence_verifications"] = np.asarray(out.seq_rounds)[:real].tolist()
        stats["sequence_accepted_tokens"] = (per_sequence * np.arange(per_sequence.shape[1])).sum(1).tolist()
        # tau: tokens emitted per verification, bonus included (the prefill's first token excluded)
        stats["mean_accepted_length"] = float((histogram * np.arange(len(histogram))).sum() / max(verifications, 1))
        stats["accepted_length_histogram"] = histogram.tolist()
        stats["rounds"] = rounds + 1  # + the prefill, as for "ar"
        stats["options"] = dict(static["options"])  # the method's options, defaults filled in
    return stats


def proposal_tree(bundle, prompt, *, method: str = "weaver", temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0, **method_options) -> dict:
    """The first round's proposal tree for one prompt (token ids), and what the target accepted of
    it: {"tokens", "parent", "depth": [N] for the valid nodes (node 0 is the root, the token the
    prefill produced), "accepted": node indices of the accepted path, root first, "bonus": the
    target's token after it}. For plotting and inspection; `generate` does the same round inside.

        tree = weaver_jax.proposal_tree(bundle, ids, method="weaver", budget=24)
        [tree["tokens"][i] for i in tree["accepted"]], tree["bonus"]    # the accepted path, then the bonus
    """
    fn, static, args = _prepare(bundle, [prompt], method, bundle.drafter.config.block_size + 1, temperature, top_k,
                                top_p, seed, [], method_options, round_only=True)
    with _mesh_scope(bundle):
        compiled = _compiled(fn, static, *args)
    tree, acc = compiled(*args)
    valid = np.asarray(tree.valid[0])
    n = int(acc.length[0])
    return {"tokens": np.asarray(tree.tokens[0])[valid].tolist(), "parent": np.asarray(tree.parent[0])[valid].tolist(),
            "depth": np.asarray(tree.depth[0])[valid].tolist(), "accepted": np.asarray(acc.path[0])[:n].tolist(),
            "bonus": int(acc.bonus[0])}
