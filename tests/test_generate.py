"""Autoregressive generation: greedy equals a plain recompute-everything loop; EOS and
max_new_tokens are exact; sampling is reproducible per sequence and draws from the filtered
target distribution (checked against an independent NumPy filter)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import weaver_jax
from weaver_jax import KVCache, Sampling
from weaver_jax._sampling import select

from .conftest import make_pair


def plain_greedy(target, prompt: list[int], n: int, width: int = 32) -> list[int]:
    """Recompute the whole sequence every step (no cache reuse) and take the argmax. The sequence
    is zero-padded to `width` (every prompt's: at least its final length): under the causal mask
    padding after a token cannot change that token's logits, and one shape means one compilation."""
    total = len(prompt) + n
    assert total <= width
    seq = np.zeros(width, np.int32)
    seq[: len(prompt)] = prompt
    cache = KVCache.init(target.config, 1, width)
    for t in range(len(prompt), total):
        seq[t] = int(_forward_argmax(target, jnp.asarray(seq[None]), cache)[t - 1])
    return seq[len(prompt):total].tolist()


@nnx.jit
def _forward_argmax(target, ids, cache):
    """The argmax after every position of one whole-sequence forward (jitted: one compile per model
    and length instead of one per eager op)."""
    return jnp.argmax(target(ids, jnp.arange(ids.shape[1])[None], cache).logits[0], -1)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_plain_decoding(family, seed):
    cfg, _, target = make_pair(family, seed=seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (4, 13, 1)]
    out = weaver_jax.generate(weaver_jax.Bundle(target), prompts, max_new_tokens=10)
    for p, tokens in zip(prompts, out.tokens, strict=False):
        assert tokens == plain_greedy(target, p, 10)
    assert out.stats["rounds"] == 10 and out.stats["new_tokens"] == 30


def test_eos_stops_each_sequence_and_max_new_tokens_is_exact(programs):
    """...and lengths of one bucket (up to 32) and EOS sets of up to 4 ids share one compiled program: the limit and
    the EOS ids are traced arguments."""
    bundle = weaver_jax.testing.random_bundle(3)
    prompts = [[5, 6, 7], [9, 1, 2, 3, 4]]
    free = weaver_jax.generate(bundle, prompts, max_new_tokens=9, eos_token_id=[]).tokens
    assert [len(t) for t in free] == [9, 9]
    eos = free[0][3]
    first = free[0].index(eos)
    out = weaver_jax.generate(bundle, prompts, max_new_tokens=9, eos_token_id=eos)
    assert out.tokens[0] == free[0][: first + 1]  # EOS included, nothing after it
    expected1 = free[1][: free[1].index(eos) + 1] if eos in free[1] else free[1]
    assert out.tokens[1] == expected1
    assert out.stats["rounds"] == max(len(t) for t in out.tokens)
    assert out.stats["finish_reasons"][0] == "stop"
    assert weaver_jax.generate(bundle, prompts, max_new_tokens=1).tokens == [t[:1] for t in free]
    eos3 = [free[1][2], 127, 126]
    three = weaver_jax.generate(bundle, prompts, max_new_tokens=4, eos_token_id=eos3)
    assert three.tokens == [cut(t, 4, eos3) for t in free] and three.stats["finish_reasons"][1] == "stop"
    assert len(programs) == 1, list(programs)


def cut(tokens: list[int], n: int, eos: list[int]) -> list[int]:
    """The first n of tokens generated without EOS, up to and with the first of `eos`."""
    return next((tokens[: i + 1] for i, t in enumerate(tokens[:n]) if t in eos), tokens[:n])


def test_pad_to_shares_one_compilation_and_changes_nothing():
    bundle = weaver_jax.testing.random_bundle(3)
    prompts = [[5, 6, 7], [9, 1, 2, 3, 4]]
    want = weaver_jax.generate(bundle, prompts, max_new_tokens=5).tokens
    padded = weaver_jax.generate(bundle, prompts, max_new_tokens=5, pad_to=40)
    assert padded.tokens == want
    other = weaver_jax.generate(bundle, [[1] * 40, [2]], max_new_tokens=5, pad_to=40)
    assert other.stats["compile_seconds"] < padded.stats["compile_seconds"] / 10  # the compiled function, reused


def test_compiled_programs_are_kept_up_to_a_bound_least_recently_used_first(monkeypatch):
    from weaver_jax import _generate

    monkeypatch.setattr(_generate, "MAX_COMPILED", 2)
    monkeypatch.setattr(_generate, "_COMPILED", type(_generate._COMPILED)())
    double = jax.jit(lambda x: 2 * x)
    first, second = (_generate._compiled(double, {}, jnp.zeros(n)) for n in (1, 2))
    assert _generate._compiled(double, {}, jnp.zeros(1)) is first  # used again: now the most recent
    _generate._compiled(double, {}, jnp.zeros(3))  # evicts the least recently used, n = 2
    assert _generate._compiled(double, {}, jnp.zeros(1)) is first and len(_generate._COMPILED) == 2
    again = _generate._compiled(double, {}, jnp.zeros(2))
    assert again is not second and np.asarray(again(jnp.ones(2))).tolist() == [2.0, 2.0]


def test_generate_reads_weights_changed_in_place():
    """A model's split is kept between calls only while its structure is the same, and its state is rebuilt from
    the arrays it holds now: weights changed in place (training does) are what the next call reads, and a new
    attribute makes a new split."""
    from weaver_jax._generate import split

    bundle = weaver_jax.testing.random_bundle(3)
    prompts = [[5, 6, 7], [9, 1, 2, 3, 4]]
    want = weaver_jax.generate(bundle, prompts, max_new_tokens=5).tokens
    bundle.target.embed[...] = -bundle.target.embed[...]
    changed = weaver_jax.generate(bundle, prompts, max_new_tokens=5).tokens
    fresh = weaver_jax.Bundle(nnx.clone(bundle.target))  # never split before
    assert changed == weaver_jax.generate(fresh, prompts, max_new_tokens=5).tokens != want
    bundle.target.note = "an attribute"
    graphdef, state = split(bundle.target)
    assert graphdef == nnx.split(bundle.target)[0]
    assert all(a is b for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(bundle.target), strict=True))


def test_weaver_tables_are_made_again_only_when_weights_change():
    """Weaver's tables are kept between calls while the adapter's and the target's arrays are the same objects; a
    weight changed in place makes them again (their values: what a fresh bundle gets)."""
    from weaver_jax._generate import split_models

    bundle = weaver_jax.testing.random_bundle(3)
    tables = split_models(bundle, "weaver")["tables"]
    assert split_models(bundle, "weaver")["tables"] is tables
    leaf = next(v for _, v in nnx.iter_graph(bundle.adapter) if isinstance(v, nnx.Param))
    leaf[...] = leaf[...] + 1.0
    remade = split_models(bundle, "weaver")["tables"]
    fresh = weaver_jax.Bundle(bundle.target, drafter=bundle.drafter, adapter=nnx.clone(bundle.adapter))
    want = split_models(fresh, "weaver")["tables"]
    assert remade is not tables
    chex.assert_trees_all_equal(remade, want)


def test_bundle_default_eos_is_used():
    bundle = weaver_jax.testing.random_bundle(3)
    free = weaver_jax.generate(bundle, [[5, 6, 7]], max_new_tokens=6).tokens[0]
    bundle.eos_token_ids = (free[1],)
    assert weaver_jax.generate(bundle, [[5, 6, 7]], max_new_tokens=6).tokens[0] == free[: free.index(free[1]) + 1]


SAMPLING = dict(temperature=0.8, top_k=12, top_p=0.9)


def test_sampling_is_reproducible_and_independent_of_batch_composition():
    bundle = weaver_jax.testing.random_bundle(4)
    a, b, c = [1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [40]
    batch = weaver_jax.generate(bundle, [a, b, c], max_new_tokens=12, seed=[11, 12, 13], **SAMPLING).tokens
    assert batch == weaver_jax.generate(bundle, [a, b, c], max_new_tokens=12, seed=[11, 12, 13], **SAMPLING).tokens
    assert weaver_jax.generate(bundle, [c], max_new_tokens=12, seed=[13], **SAMPLING).tokens[0] == batch[2]
    assert weaver_jax.generate(bundle, [b, a], max_new_tokens=12, seed=[12, 11], **SAMPLING).tokens == batch[1::-1]
    # an int seed gives sequence i the key fold_in(key(seed), i), whatever else is in the batch
    alone = weaver_jax.generate(bundle, [a], max_new_tokens=12, seed=5, **SAMPLING).tokens[0]
    assert weaver_jax.generate(bundle, [a, c], max_new_tokens=12, seed=5, **SAMPLING).tokens[0] == alone
    other = weaver_jax.generate(bundle, [a], max_new_tokens=12, seed=6, **SAMPLING).tokens[0]
    assert other != alone


def numpy_filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Temperature, then top-k, then the smallest top-p nucleus, renormalised (float64)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), bool)
    k = top_k if top_k else len(z)
    candidates = order[:k]
    p = np.exp(z[candidates] - z[candidates].max())
    p /= p.sum()
    cum = 0.0
    for idx, pi in zip(candidates, p, strict=False):
        keep[idx] = True
        cum += pi
        if cum >= top_p:
            break
    out = np.where(keep, np.exp(z - z.max()), 0.0)
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 5, 1.0), (1.0, 8, 0.6)])
def test_sampler_draws_from_the_filtered_distribution(temperature, top_k, top_p):
    rng = np.random.default_rng(int(temperature * 10) + top_k)
    vocab, draws = 24, 40_000
    logits = rng.standard_normal(vocab).astype(np.float32) * 2
    sampling = Sampling(temperature, top_k, top_p)
    keys = jax.vmap(jax.random.key)(jnp.arange(draws))
    tokens = np.asarray(select(jnp.broadcast_to(jnp.asarray(logits), (draws, vocab)), keys, jnp.int32(3), sampling))
    expected = numpy_filtered_probs(logits, temperature, top_k, top_p)
    freq = np.bincount(tokens, minlength=vocab) / draws
    assert np.all(freq[expected == 0] == 0), "a filtered-out token was sampled"
    sigma = np.sqrt(expected * (1 - expected) / draws)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-12), (freq, expected)
    chi2 = np.sum((freq - expected)[expected > 0] ** 2 / expected[expected > 0]) * draws
    dof = int((expected > 0).sum()) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10


def test_greedy_sampling_is_argmax():
    logits = jax.random.normal(jax.random.key(0), (6, 50))
    keys = jax.vmap(jax.random.key)(jnp.arange(6))
    assert np.array_equal(select(logits, keys, jnp.int32(0), Sampling()), np.argmax(logits, -1))


def test_ar_generate_is_a_pure_jittable_function():
    """The documented pure entry point: split the model, pass a cache, get arrays back."""
    from flax import nnx

    bundle = weaver_jax.testing.random_bundle(6, family="qwen3")
    graphdef, params = nnx.split(bundle.target)
    prompts = jnp.array([[3, 4, 5, 0], [6, 7, 8, 9]], jnp.int32)
    lengths = jnp.array([3, 4], jnp.int32)
    cache = KVCache.init(bundle.config, 2, 32)
    out = weaver_jax.ar_generate(params, cache, prompts, lengths, weaver_jax.sequence_keys(0, 2),
                                 graphdef=graphdef, max_new_tokens=5)
    assert out.tokens.shape == (2, 5) and np.array_equal(out.num_tokens, [5, 5])
    assert np.array_equal(out.cache.lengths, lengths + 4)  # the last token is not yet in the cache
    high = weaver_jax.generate(bundle, [[3, 4, 5], [6, 7, 8, 9]], max_new_tokens=5).tokens
    assert np.asarray(out.tokens).tolist() == high
    # a traced limit under a wider buffer, and traced EOS ids (-1: none): what generate passes
    out = weaver_jax.ar_generate(params, KVCache.init(bundle.config, 2, 32), prompts, lengths,
                                 weaver_jax.sequence_keys(0, 2), 3, jnp.asarray([high[1][1], -1]),
                                 graphdef=graphdef, max_new_tokens=8)
    assert out.tokens.shape == (2, 8) and np.asarray(out.num_tokens).tolist() == [3, 2]
    assert np.asarray(out.tokens).tolist() == [high[0][:3] + [-1] * 5, high[1][:2] + [-1] * 6]
