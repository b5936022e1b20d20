"""Speculative methods are lossless: greedy output equals plain decoding, sampled output has the
autoregressive distribution, and the committed cache equals plain decoding's."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import weaver_jax
from weaver_jax import KVCache
from weaver_jax.testing import random_bundle

from .drafters import OracleDrafter
from .test_generate import numpy_filtered_probs

# weaver: one node per adapter call, so trees reach the full depth (a tree is at most as deep as its calls)
METHODS = [("dflash", {}), ("ddtree", {"budget": 12}), ("weaver", {"budget": 12, "expansions_per_call": 1})]


def bundles(seed: int, tie: bool):
    """A random drafter, an oracle, and a corrupted oracle for the same random target."""
    rb = random_bundle(seed, tie_embeddings=tie, family="qwen3" if seed % 2 else "llama", block_size=6)
    yield "random", rb
    for corrupt in (False, True):
        yield f"oracle{'-corrupt' if corrupt else ''}", weaver_jax.Bundle(
            rb.target, drafter=OracleDrafter(rb.config, block_size=6, corrupt=corrupt), adapter=rb.adapter)


# every method on llama (untied); the tied qwen3 target with Weaver only (the target's family is not the trees')
@pytest.mark.parametrize("seed,tie,method,options", [(0, False, *m) for m in METHODS] + [(1, True, *METHODS[-1])])
def test_greedy_equals_autoregressive(seed, tie, method, options):
    rng = np.random.default_rng(seed)
    for name, bundle in bundles(seed, tie):
        prompts = [rng.integers(0, 100, n).tolist() for n in (5, 12, 2)]
        for batch in ([prompts[0]], prompts) if seed == 0 else (prompts,):  # batch 1 once per drafter
            ar = weaver_jax.generate(bundle, batch, max_new_tokens=20)
            spec = weaver_jax.generate(bundle, batch, method=method, max_new_tokens=20, **options)
            assert spec.tokens == ar.tokens, (name, method)
            if name == "oracle":  # a perfect drafter: every round accepts the whole block
                assert spec.stats["mean_accepted_length"] > 4, spec.stats
            hist = spec.stats["accepted_length_histogram"]
            assert sum(hist) > 0 and hist[0] == 0


@pytest.mark.parametrize("method,options", [
    ("dflash", {"depth": 2}), ("weaver", {"budget": 6, "depth": 3, "marginal_tail": 0}),
    # one adapter call makes depth 1; the marginal tail's 3 nodes reach depth 4
    ("weaver", {"budget": 5, "depth": 4, "expansions_per_call": 5, "marginal_tail": 3})])
def test_shallow_trees_are_lossless(method, options):
    """`depth` caps the tree (the drafter projects only that many positions): still plain decoding's
    tokens, and no round accepts more than depth + 1 tokens even with a perfect drafter, which fills
    the tree to that depth."""
    rb = random_bundle(2, block_size=6)
    bundle = weaver_jax.Bundle(rb.target, drafter=OracleDrafter(rb.config, block_size=6), adapter=rb.adapter)
    prompts = [[5, 6, 7], [9, 1, 2, 3, 4]]
    ar = weaver_jax.generate(bundle, prompts, max_new_tokens=12)
    spec = weaver_jax.generate(bundle, prompts, method=method, max_new_tokens=12, **options)
    assert spec.tokens == ar.tokens
    assert len(spec.stats["accepted_length_histogram"]) == options["depth"] + 2
    assert spec.stats["accepted_length_histogram"][-1] > 0  # the oracle fills the shallow tree


@pytest.mark.parametrize("method,options", METHODS)
def test_eos_and_max_new_tokens_are_exact(method, options, programs):
    """...in one compiled program per method, whatever max_new_tokens (up to 32) and EOS ids."""
    rb = random_bundle(3, block_size=6)
    oracle = OracleDrafter(rb.config, block_size=6, corrupt=True)
    bundle = weaver_jax.Bundle(rb.target, drafter=oracle, adapter=rb.adapter)
    prompts = [[5, 6, 7], [9, 1, 2, 3, 4], [17]]
    free = weaver_jax.generate(bundle, prompts, max_new_tokens=15, eos_token_id=[]).tokens
    for max_new in (1, 4):  # the prefill's token alone; a round cut short (15: the EOS run below)
        out = weaver_jax.generate(bundle, prompts, method=method, max_new_tokens=max_new, eos_token_id=[], **options)
        assert out.tokens == [t[:max_new] for t in free]
    eos = free[0][5]
    ar = weaver_jax.generate(bundle, prompts, max_new_tokens=15, eos_token_id=eos).tokens
    spec = weaver_jax.generate(bundle, prompts, method=method, max_new_tokens=15, eos_token_id=eos, **options)
    assert spec.tokens == ar
    assert ar[0] == free[0][: free[0].index(eos) + 1]
    assert len(programs) == 2, list(programs)  # ar's and the method's


@pytest.mark.parametrize("method,options", METHODS)
def test_committed_cache_equals_plain_decoding(method, options):
    """After the rounds, slots [0, len) hold exactly the K/V a plain forward over the committed
    tokens (prompt + every emitted token but the last) computes, and len counts them."""
    from flax import nnx

    from weaver_jax._speculative import spec_generate, tree_options

    rb = random_bundle(4, block_size=6)
    oracle = OracleDrafter(rb.config, block_size=6, corrupt=True)
    bundle = weaver_jax.Bundle(rb.target, drafter=oracle, adapter=rb.adapter)
    prompts = np.array([[3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 11, 12]], np.int32)
    lengths = np.array([4, 6], np.int32)
    graphdef, params = nnx.split(bundle.target)
    dgraphdef, dparams = nnx.split(bundle.drafter)
    agraphdef, aparams = nnx.split(bundle.adapter)
    options = tree_options(method, options, block_size=6, vocab_size=bundle.config.vocab_size, pool_size=64)
    out = spec_generate(params, dparams, KVCache.init(bundle.config, 2, 64), bundle.drafter.init_cache(2, 64),
                        prompts, lengths, weaver_jax.sequence_keys(0, 2), aparams, graphdef=graphdef,
                        drafter_graphdef=dgraphdef, adapter_graphdef=agraphdef, method=method,
                        options=tuple(sorted(options.items())), max_new_tokens=17)
    assert int(out.rounds) < 17  # several tokens per round were committed
    for b in range(2):
        emitted = np.asarray(out.tokens[b, : int(out.num_tokens[b])])
        committed = np.concatenate([prompts[b, : lengths[b]], emitted[:-1]])
        assert int(out.cache.lengths[b]) == len(committed)
        ref = bundle.target(jnp.asarray(committed[None]), jnp.arange(len(committed))[None],
                            KVCache.init(bundle.config, 1, 64)).cache
        for layer in range(bundle.config.num_layers):
            np.testing.assert_allclose(out.cache.k[layer][b, : len(committed)], ref.k[layer][0, : len(committed)],
                                       atol=1e-5)
            np.testing.assert_allclose(out.cache.v[layer][b, : len(committed)], ref.v[layer][0, : len(committed)],
                                       atol=1e-5)


def exact_three_token_distribution(target, prompt: list[int], temperature: float, top_k: int = 0,
                                   top_p: float = 1.0) -> np.ndarray:
    """P(x1, x2, x3 | prompt) of autoregressive sampling (temperature, top-k, top-p), enumerated
    from the target with the independent NumPy filter of test_generate."""
    v = target.config.vocab_size
    probs = np.zeros((v, v, v))
    seqs = list(itertools.product(range(v), repeat=2))
    ids = np.array([prompt + list(seq) for seq in seqs])  # every continuation in one forward
    logits = np.asarray(target(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape),
                               target.init_cache(len(seqs), ids.shape[1])).logits, np.float64)
    for seq, rows in zip(seqs, logits, strict=True):
        p = np.stack([numpy_filtered_probs(row, temperature, top_k, top_p) for row in rows[len(prompt) - 1 :]])
        probs[seq[0], seq[1], :] = p[0, seq[0]] * p[1, seq[1]] * p[2]
    return probs


@pytest.mark.parametrize("method,options,sampling,drafter", [
    ("dflash", {}, dict(temperature=0.5), "target logits"),
    ("ddtree", {"budget": 12}, dict(temperature=1.3, top_k=5), "random"),
    ("weaver", {"budget": 12, "expansions_per_call": 1, "children_per_node": 3, "root_children": 9},
     dict(temperature=0.6, top_k=8, top_p=0.9), "oracle"),
])
def test_sampling_is_seed_identical_to_autoregressive(method, options, sampling, drafter):
    """With the same seed every method samples exactly `ar`'s tokens (ragged batch, per-sequence and
    shared seeds): the draw of each generated token is keyed by its index in both. The drafts are
    coupled to those draws (`coupled_drafts`): a drafter whose first position is the target's own
    distribution proposes there exactly the token the target draws, so every round accepts it (an
    uncoupled draft - the argmax - only with the target's probability of it)."""
    rb = random_bundle(3, block_size=6)
    bundle = rb if drafter == "random" else weaver_jax.Bundle(
        rb.target, drafter=OracleDrafter(rb.config, block_size=6, logits=drafter == "target logits"),
        adapter=rb.adapter)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [3, 4]]
    for seed in (7, [3, 1, 4]):
        ar = weaver_jax.generate(bundle, prompts, max_new_tokens=20, seed=seed, eos_token_id=[], **sampling)
        spec = weaver_jax.generate(bundle, prompts, method=method, max_new_tokens=20, seed=seed, eos_token_id=[],
                                   **sampling, **options)
        assert spec.tokens == ar.tokens, (seed, spec.tokens, ar.tokens)
        assert drafter == "random" or spec.stats["mean_accepted_length"] > 1.2, spec.stats  # paths past the root
        if drafter == "target logits":  # no round stops at the root
            assert spec.stats["accepted_length_histogram"][1] == 0, spec.stats
    other = weaver_jax.generate(bundle, prompts, method=method, max_new_tokens=20, seed=8, eos_token_id=[],
                                **sampling, **options)
    assert other.tokens != spec.tokens  # the seed matters


@pytest.mark.parametrize("method,options,sampling", [  # (DDTree: its tokens are `ar`'s, seed-identical tests)
    ("dflash", {}, dict(temperature=1.0)),
    ("weaver", {"budget": 6}, dict(temperature=0.7, top_k=3, top_p=0.9)),  # filtered
])
def test_sampling_matches_the_autoregressive_distribution(method, options, sampling):
    """16000 samples of the first 3 tokens: chi-square over the 64 outcomes against the exact
    probabilities, and a per-token check of the first token that a 2% bias would fail
    (sd of a frequency <= 0.4%, so 2% is > 5 sd). The prompt is not padded (`pad_to`): padded to 32
    positions (the default), the 16000 rows' prefill took about half the runtime."""
    rb = random_bundle(5, vocab_size=4, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16, block_size=4)
    prompt = [1, 3, 0]
    n = 16_000
    exact = exact_three_token_distribution(rb.target, prompt, **sampling)
    oracle = weaver_jax.Bundle(rb.target, drafter=OracleDrafter(rb.config, block_size=4), adapter=rb.adapter)
    for bundle in (rb, oracle):
        out = weaver_jax.generate(bundle, [prompt] * n, method=method, max_new_tokens=3, eos_token_id=[],
                                  seed=list(range(n)), pad_to=len(prompt), **sampling, **options)
        assert_three_token_distribution(out.tokens, exact)
        if isinstance(bundle.drafter, OracleDrafter):
            assert out.stats["mean_accepted_length"] > 1.3, out.stats


def assert_three_token_distribution(tokens: list[list[int]], exact: np.ndarray):
    """Samples of 3 tokens against `exact_three_token_distribution`: no excluded outcome, chi-square ~6 sd
    above its mean at most, and every first token's frequency within 1% at 16000 samples (> 5 sd), within
    as many standard deviations at other counts."""
    n, v = len(tokens), exact.shape[0]
    samples = np.array(tokens)
    counts = np.zeros((v, v, v))
    np.add.at(counts, (samples[:, 0], samples[:, 1], samples[:, 2]), 1)
    possible = exact > 0
    assert counts[~possible].sum() == 0, "an outcome the filters exclude was sampled"
    expected = exact[possible] * n
    dof = int(possible.sum()) - 1
    chi2 = ((counts[possible] - expected) ** 2 / expected).sum()
    assert chi2 < dof + 6 * np.sqrt(2 * dof), chi2  # ~ 6 sd above the mean of chi2(dof)
    first = counts.sum((1, 2)) / n
    assert np.all(np.abs(first - exact.sum((1, 2))) < 0.01 * np.sqrt(16_000 / n)), first


def test_speculative_bad_input():
    rb = random_bundle(6, block_size=6)
    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        weaver_jax.generate(rb, [[1]], method="ddtree", max_new_tokens=2, budget=0)
    with pytest.raises(ValueError, match="larger than the frontier allows"):
        weaver_jax.generate(rb, [[1]], method="ddtree", max_new_tokens=2, budget=10**6)
    with pytest.raises(ValueError, match="block_size=16 was requested but the drafter was trained with 6"):
        weaver_jax.generate(rb, [[1]], method="dflash", max_new_tokens=2, block_size=16)
    with pytest.raises(TypeError, match="takes no options besides block_size and depth"):
        weaver_jax.generate(rb, [[1]], method="dflash", max_new_tokens=2, budget=8)
    for depth in (0, 6, 2.5):
        with pytest.raises(ValueError, match=r"depth must be an integer in \[1, 5\]"):
            weaver_jax.generate(rb, [[1]], method="dflash", max_new_tokens=2, depth=depth)
    with pytest.raises(ValueError, match="needs a drafter"):
        weaver_jax.generate(weaver_jax.Bundle(rb.target), [[1]], method="ddtree", max_new_tokens=2)
    (graphdef, params), (drafter_graphdef, drafter_params) = nnx.split(rb.target), nnx.split(rb.drafter)
    with pytest.raises(ValueError, match=r"options=\(\('depth', 5\),\) for the chain"):  # the raw API, no options
        weaver_jax.spec_generate(params, drafter_params, rb.target.init_cache(1, 64), rb.drafter.init_cache(1, 64),
                                 jnp.ones((1, 4), jnp.int32), jnp.asarray([4]), weaver_jax.sequence_keys(0, 1),
                                 graphdef=graphdef, drafter_graphdef=drafter_graphdef, method="dflash",
                                 max_new_tokens=2)
    with pytest.raises(ValueError, match="needs an adapter"):
        weaver_jax.generate(weaver_jax.Bundle(rb.target, drafter=rb.drafter), [[1]], method="weaver", max_new_tokens=2)
    with pytest.raises(ValueError, match=r"children_per_node must be an integer in \[1, pool_size=16\]"):
        weaver_jax.generate(rb, [[1]], method="weaver", max_new_tokens=2, pool_size=16, children_per_node=17)
    with pytest.raises(ValueError, match=r"root_children must be an integer in \[1, pool_size=16\]"):
        weaver_jax.generate(rb, [[1]], method="weaver", max_new_tokens=2, pool_size=16, root_children=0)
    with pytest.raises(ValueError, match=r"pool_size must be an integer in \[1, 128\]"):
        weaver_jax.generate(rb, [[1]], method="weaver", max_new_tokens=2, pool_size=1000)
    with pytest.raises(ValueError, match=r"marginal_tail must be an integer in \[0, budget=4\)"):
        weaver_jax.generate(rb, [[1]], method="weaver", max_new_tokens=2, budget=4, marginal_tail=4)
    with pytest.raises(TypeError, match=r"unknown options \['width'\]"):
        weaver_jax.generate(rb, [[1]], method="weaver", max_new_tokens=2, width=3)
    other = random_bundle(7, hidden_size=32, num_layers=1)
    with pytest.raises(ValueError, match=r"drafter does not match the target: target width 32 != 64"):
        weaver_jax.generate(weaver_jax.Bundle(rb.target, drafter=other.drafter), [[1]], method="dflash",
                            max_new_tokens=2)
    small_vocab = random_bundle(8, vocab_size=64)
    with pytest.raises(ValueError, match="vocabulary 64 != 128"):
        weaver_jax.generate(weaver_jax.Bundle(rb.target, drafter=small_vocab.drafter), [[1]], method="dflash",
                            max_new_tokens=2)
    deep = random_bundle(9, num_layers=4, drafter_layers=3)
    with pytest.raises(ValueError, match=r"target_layer_ids \(0, 2, 3\) outside the target's 2 layers"):
        weaver_jax.generate(weaver_jax.Bundle(rb.target, drafter=deep.drafter), [[1]], method="dflash",
                            max_new_tokens=2)


@pytest.mark.parametrize("method", ["ddtree", "weaver"])
def test_proposal_tree_is_the_first_round(method):
    """`proposal_tree` shows the round `generate` runs first: its root is the prefill's token, the
    accepted path is a chain of the tree, and path + bonus are the next tokens generate emits."""
    bundle = random_bundle(4, vocab_size=64, block_size=6)
    prompt = [3, 9, 27, 17]
    tree = weaver_jax.proposal_tree(bundle, prompt, method=method, budget=12)
    assert len(tree["tokens"]) == 13 and tree["parent"][0] == -1 and tree["accepted"][0] == 0
    for child, parent in zip(tree["accepted"][1:], tree["accepted"], strict=False):
        assert tree["parent"][child] == parent
    out = weaver_jax.generate(bundle, [prompt], method=method, max_new_tokens=8, eos_token_id=[], budget=12).tokens[0]
    emitted = [tree["tokens"][i] for i in tree["accepted"]] + [tree["bonus"]]
    assert out[: len(emitted)] == emitted
