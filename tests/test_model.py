"""The Flax target against the independent float64 NumPy reference, and the cache invariants:
prefill + decode steps = one forward, tree verification = sequential decoding along each path,
ragged batches = single sequences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import weaver_jax
from weaver_jax import KVCache
from weaver_jax._model import fresh_cache

from . import reference
from .conftest import make_pair

# float32 against float64 over 2 layers of width 64: observed max |diff| ~1e-6 of logits of
# magnitude ~3; 1e-4 leaves room for summation-order changes without hiding a wrong formula
# (a wrong RoPE pairing or norm moves logits by > 1e-1).
ATOL_F32 = 1e-4


@nnx.jit(static_argnames="hidden_layers")
def run(target, ids, positions, cache, attend=None, hidden_layers=(), logits_rows=None):
    """`target(...)` jitted: one compile per model and shapes instead of one per eager op."""
    return target(ids, positions, cache, attend, hidden_layers=hidden_layers, logits_rows=logits_rows)


def forward_all(target, ids: np.ndarray, cache_size: int = 64, hidden_layers=()):
    b, t = ids.shape
    cache = KVCache.init(target.config, b, cache_size)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    return run(target, jnp.asarray(ids), positions, cache, hidden_layers=hidden_layers)


def test_logits_match_reference(family):
    rng = np.random.default_rng(1)
    cfg, weights, target = make_pair(family, seed=2)
    ids = rng.integers(0, cfg.vocab_size, (2, 11))
    out = forward_all(target, ids, hidden_layers=(0, 1))
    for b in range(2):
        ref_logits, ref_layers = reference.forward(cfg, weights, ids[b])
        np.testing.assert_allclose(out.logits[b], ref_logits, atol=ATOL_F32, rtol=0)
        for i in range(2):
            np.testing.assert_allclose(out.hidden[i][b], ref_layers[i], atol=ATOL_F32, rtol=0)


def test_bfloat16_params_track_reference(family):
    """bf16 weights and activations: each op rounds to 8 mantissa bits, so after 2 layers the
    logits sit within a few percent of the float64 reference on the same (rounded) weights."""
    rng = np.random.default_rng(3)
    cfg, weights, target = make_pair(family, seed=4, dtype="bfloat16")
    rounded = {k: np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32) for k, v in weights.items()}
    ids = rng.integers(0, cfg.vocab_size, (1, 9))
    logits = np.asarray(forward_all(target, ids).logits[0])
    ref, _ = reference.forward(cfg, rounded, ids[0])
    assert target.embed[...].dtype == jnp.bfloat16
    err = np.linalg.norm(logits - ref) / np.linalg.norm(ref)
    assert err < 3e-2, err


def test_prefill_then_decode_equals_full_forward(family):
    rng = np.random.default_rng(5)
    cfg, _, target = make_pair(family, seed=6)
    ids = rng.integers(0, cfg.vocab_size, (2, 12))
    full = forward_all(target, ids).logits
    cache = KVCache.init(cfg, 2, 32)
    n_prefill = 7
    out = run(target, jnp.asarray(ids[:, :n_prefill]), jnp.broadcast_to(jnp.arange(n_prefill), (2, n_prefill)), cache)
    np.testing.assert_allclose(out.logits, full[:, :n_prefill], atol=ATOL_F32)
    cache = out.cache.with_lengths(jnp.full((2,), n_prefill))
    for t in range(n_prefill, 12):
        out = run(target, jnp.asarray(ids[:, t : t + 1]), cache.lengths[:, None], cache)
        np.testing.assert_allclose(out.logits[:, 0], full[:, t], atol=ATOL_F32)
        cache = out.cache.with_lengths(cache.lengths + 1)


def random_tree(rng, n: int) -> np.ndarray:
    """Parent of each node (node 0 = root, parents before children)."""
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])


def ancestor_matrix(parent: np.ndarray) -> np.ndarray:
    n = len(parent)
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        anc[i] |= anc[parent[i]]
    return anc


def depths(parent: np.ndarray) -> np.ndarray:
    d = np.zeros(len(parent), int)
    for i in range(1, len(parent)):
        d[i] = d[parent[i]] + 1
    return d


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_tree_verify_equals_sequential_decoding(family, shape):
    """Verification of N nodes in one forward (ancestor mask, positions len + depth) gives every
    node the logits of decoding its root-to-node path one token at a time."""
    rng = np.random.default_rng(7)
    cfg, _, target = make_pair(family, seed=8)
    prompt_lengths = np.array([5, 9])
    n = 9
    parent = np.arange(-1, n - 1) if shape == "chain" else random_tree(rng, n)
    anc, depth = ancestor_matrix(parent), depths(parent)
    prompts = rng.integers(0, cfg.vocab_size, (2, 9))
    nodes = rng.integers(0, cfg.vocab_size, (2, n))

    cache = KVCache.init(cfg, 2, 48)
    out = run(target, jnp.asarray(prompts), jnp.broadcast_to(jnp.arange(9), (2, 9)), cache)
    cache = out.cache.with_lengths(jnp.asarray(prompt_lengths))
    positions = prompt_lengths[:, None] + depth[None, :]
    tree = run(target, jnp.asarray(nodes), jnp.asarray(positions), cache, jnp.broadcast_to(anc, (2, n, n)))
    assert np.array_equal(tree.cache.lengths, prompt_lengths)  # verification never commits

    for b in range(2):
        for node in range(n):
            path = np.flatnonzero(anc[node])  # ancestors in order: parents precede children
            seq = np.concatenate([prompts[b, : prompt_lengths[b]], nodes[b, path]])
            padded = np.pad(seq, (0, 20 - len(seq)))  # causal: padding after cannot matter
            ref = forward_all(target, padded[None], cache_size=48).logits[0, len(seq) - 1]
            np.testing.assert_allclose(tree.logits[b, node], ref, atol=ATOL_F32)


def test_ragged_batch_equals_single_sequences(family):
    cfg, _, target = make_pair(family, seed=9)
    bundle = weaver_jax.Bundle(target)
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 17, 8)]
    batched = weaver_jax.generate(bundle, prompts, max_new_tokens=12).tokens
    for p, tokens in zip(prompts, batched, strict=False):
        assert weaver_jax.generate(bundle, [p], max_new_tokens=12).tokens[0] == tokens


def test_logits_rows_and_hidden_layer_errors():
    cfg, _, target = make_pair("llama3", seed=11)
    ids = np.arange(10)[None] % cfg.vocab_size
    full = forward_all(target, ids).logits
    cache = KVCache.init(cfg, 1, 16)
    rows = run(target, jnp.asarray(ids), jnp.arange(10)[None], cache, logits_rows=jnp.array([[9, 2]])).logits
    np.testing.assert_allclose(rows[0], full[0, [9, 2]], atol=ATOL_F32)
    with pytest.raises(ValueError, match="hidden_layers"):
        target(jnp.asarray(ids), jnp.arange(10)[None], cache, hidden_layers=(cfg.num_layers,))


def test_cache_write_places_rows_at_each_length_and_drops_past_the_end():
    """The K/V write (one scatter) against a plain loop over rows on fresh random inputs: ragged
    lengths, rows that would run past the cache dropped (never shifted back over earlier slots)."""
    from weaver_jax._model import _write

    rng = np.random.default_rng()
    b, s, t = 4, 40, 7
    cache = rng.standard_normal((b, s, 2, 8)).astype(np.float32)
    new = rng.standard_normal((b, t, 2, 8)).astype(np.float32)
    lengths = np.array([0, rng.integers(1, s - t), s - t, s - 3])  # the last one runs 4 rows past the end
    expected = cache.copy()
    for row in range(b):
        for i in range(t):
            if lengths[row] + i < s:
                expected[row, lengths[row] + i] = new[row, i]
    np.testing.assert_array_equal(_write(jnp.asarray(cache), jnp.asarray(new), jnp.asarray(lengths)), expected)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_fresh_cache_is_init_cache_from_one_program(family):
    """`fresh_cache` (host code's: one compiled program) equals `init_cache` (traced code's), target and drafter."""
    bundle = weaver_jax.testing.random_bundle(0, family=family)
    for model, size in ((bundle.target, 96), (bundle.drafter, 40)):
        fresh, plain = fresh_cache(model, 3, size), model.init_cache(3, size)
        assert jax.tree.structure(fresh) == jax.tree.structure(plain)
        for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(plain), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype and not np.any(np.asarray(a))
