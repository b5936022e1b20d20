"""The hybrid (Qwen3.5-style) target: decoding token by token equals one prefill of the whole
sequence (ragged batch); every node of a verified tree has the logits of the prefill of its own path,
and committing a path leaves the cache (K/V and GDN states) a prefill of that path leaves; every
speculative method generates `ar`'s tokens with it (greedy, seeded sampling) and its distribution."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import weaver_jax
from weaver_jax._hybrid import random_hybrid
from weaver_jax._speculative import commit_kv
from weaver_jax.pallas_kernels import kernel_scope
from weaver_jax.testing import random_bundle

from .drafters import OracleDrafter
from .test_pallas_row_invariant import random_paths
from .test_speculative import assert_three_token_distribution, exact_three_token_distribution

TOL = dict(rtol=1e-4, atol=1e-4)


@nnx.jit
def prefill(model, tokens, cache, lengths):
    out = model.prefill(tokens, cache, lengths)
    return out.logits, out.cache


@nnx.jit
def verify(model, tokens, depth, cache, ancestors):
    out = model(tokens, cache.lengths[:, None] + depth, cache, ancestors)
    return out.logits, out.cache, out.pending


@nnx.jit
def commit(model, cache, pending, path, length):  # as a round commits: the path's K/V moved, then the states
    return model.commit(commit_kv(cache, path), pending, path, length)


def test_decode_steps_equal_one_prefill():
    model = random_hybrid(0)
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, 64, (2, 12))
    lengths = np.array([8, 5])
    whole, _ = prefill(model, jnp.asarray(seqs), model.init_cache(2, 32), jnp.asarray([12, 12]))
    logits, cache = prefill(model, jnp.asarray(np.where(np.arange(8) < lengths[:, None], seqs[:, :8], 0)),
                                  model.init_cache(2, 32), jnp.asarray(lengths))
    for r in range(2):
        np.testing.assert_allclose(logits[r, lengths[r] - 1], whole[r, lengths[r] - 1], **TOL)
    one = jnp.ones((2, 1, 1), bool)
    for step in range(4):
        token = jnp.asarray(seqs[np.arange(2), lengths + step])[:, None]
        logits, scratch, pending = verify(model, token, jnp.zeros((2, 1), jnp.int32), cache, one)
        cache = commit(model, scratch, pending, jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32))
        for r in range(2):
            np.testing.assert_allclose(logits[r, 0], whole[r, lengths[r] + step], **TOL, err_msg=f"step {step}")


def test_tree_nodes_equal_their_paths_and_commit_equals_prefill():
    model = random_hybrid(1)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 64, 7)
    _, cache = prefill(model, jnp.asarray(prompt[None]), model.init_cache(1, 32), jnp.asarray([7]))
    paths, ancestors = random_paths(rng, 10)
    ancestors = ancestors[None]
    tokens = rng.integers(0, 64, 10)
    depth = np.array([[len(p) - 1 for p in paths]])
    logits, scratch, pending = verify(model, jnp.asarray(tokens[None]), jnp.asarray(depth), cache,
                                            jnp.asarray(ancestors))

    width = 7 + depth.max() + 1  # every path's prefill in one batch, each padded after its end
    ids = np.zeros((10, width), np.int64)
    for i, p in enumerate(paths):
        ids[i, : 7 + len(p)] = np.concatenate([prompt, tokens[p]])
    alone, ref = prefill(model, jnp.asarray(ids), model.init_cache(10, 32), jnp.asarray(7 + depth[0] + 1))
    for i in range(10):
        np.testing.assert_allclose(logits[0, i], alone[i, 7 + depth[0, i]], **TOL, err_msg=f"node {i}")
    accepted = paths[int(np.argmax(depth[0]))]
    path_nodes = np.zeros((1, 10), np.int32)
    path_nodes[0, : len(accepted)] = accepted
    committed = commit(model, scratch, pending, jnp.asarray(path_nodes), jnp.asarray([len(accepted)]))
    row = int(np.argmax(depth[0]))  # the accepted path's own prefill in the batch
    n = 7 + len(accepted)
    assert int(committed.lengths[0]) == n
    for got, want in zip(committed.k + committed.v, ref.k + ref.v, strict=True):
        np.testing.assert_allclose(got[0, :n], want[row, :n], **TOL)
    for got, want in zip(committed.gdn, ref.gdn, strict=True):
        np.testing.assert_allclose(got.recurrent[0], want.recurrent[row], **TOL)
        np.testing.assert_allclose(got.conv[0], want.conv[row], **TOL)


FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def assert_matches_transformers(directory: Path, *models) -> weaver_jax.Bundle:
    """A tiny random hybrid made by transformers (tests/fixtures/make_fixtures.py), loaded from its Hugging
    Face directory (and any `models` converted from it): logits equal transformers' (float32: measured 2e-7
    apart at logits of std 0.16; the tolerance leaves float32 rounding through 4 layers 50x room), and greedy
    generation after a 70-token prompt (a two-chunk prefill, then decode steps) gives transformers' 16 tokens."""
    ref = np.load(directory / "reference.npz")
    ids = jnp.asarray(ref["ids"])
    bundle = weaver_jax.load(directory, dtype="float32")
    for model in (bundle.target, *models):
        logits, _ = prefill(model, ids, model.init_cache(*ids.shape), jnp.full((ids.shape[0],), ids.shape[1]))
        np.testing.assert_allclose(logits, ref["logits"], rtol=1e-4, atol=1e-5)
    out = weaver_jax.generate(bundle, ref["prompt"].tolist(), max_new_tokens=16, eos_token_id=[])
    assert out.tokens == ref["greedy"].tolist()
    return bundle


def test_qwen3_5_matches_transformers_and_converts(tmp_path):
    """Qwen3.5 matches transformers (`assert_matches_transformers`); `weaver-convert target` writes a checkpoint
    that loads back to the same logits, and with a drafter and an adapter beside it generates the same tokens
    by dflash. A missing or an extra tensor is named."""
    from weaver_jax.convert import checkpoint
    from weaver_jax.convert.cli import main as convert
    from weaver_jax.convert.hf import hybrid_config_from_hf, hybrid_params_from_hf, read_weights

    directory = FIXTURES / "qwen3_5"
    assert convert(["target", str(directory), str(tmp_path / "converted")]) == 0
    bundle = assert_matches_transformers(directory, weaver_jax.load(tmp_path / "converted").target)
    prompt = np.load(directory / "reference.npz")["prompt"].tolist()
    # a drafter (target layer ids over the hybrid stack) and an adapter, saved and loaded beside the converted target
    parts = random_bundle(0, vocab_size=256, hidden_size=64, num_layers=4, block_size=4)
    checkpoint.save(tmp_path / "drafter", parts.drafter)
    checkpoint.save(tmp_path / "adapter", parts.adapter)
    full = weaver_jax.load(tmp_path / "converted", drafter=tmp_path / "drafter", adapter=tmp_path / "adapter")
    ar = weaver_jax.generate(bundle, prompt, max_new_tokens=16, eos_token_id=[])
    spec = weaver_jax.generate(full, prompt, method="dflash", max_new_tokens=16, eos_token_id=[])
    assert spec.tokens == ar.tokens
    tensors = read_weights(directory)
    config = hybrid_config_from_hf(json.loads((directory / "config.json").read_text()))
    with pytest.raises(ValueError, match="missing tensor model.layers.0.linear_attn.A_log"):
        hybrid_params_from_hf(config, {n: t for n, t in tensors.items() if n != "model.layers.0.linear_attn.A_log"})
    with pytest.raises(ValueError, match="unexpected tensors: .*extra"):
        hybrid_params_from_hf(config, {**tensors, "model.extra.weight": tensors["model.norm.weight"]})


def test_qwen3_next_matches_transformers():
    """Qwen3-Next differs in its fused GDN input projections (grouped by key head), which the import unfuses:
    a tiny dense-MLP one matches transformers (`assert_matches_transformers`); a mixture-of-experts config is
    refused by name."""
    from weaver_jax.convert.hf import hybrid_config_from_hf

    directory = FIXTURES / "qwen3_next"
    assert_matches_transformers(directory)
    config = json.loads((directory / "config.json").read_text())
    with pytest.raises(ValueError, match=r"mixture-of-experts MLPs are not supported yet: layers \[0, 1, 2, 3\]"):
        hybrid_config_from_hf({**config, "num_experts": 8})


HYBRID_METHODS = [("dflash", {}), ("ddtree", {"budget": 6}), ("weaver", {"budget": 6, "expansions_per_call": 2})]
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [3]]


def test_every_method_greedy_equals_autoregressive_on_a_hybrid_target():
    """Ragged batch, a random drafter for every method; then a corrupted oracle drafter (long accepted paths
    folded into the GDN states, rejections mid-path) with the acceptance kernel, which moves the attention
    layers' K/V in place and must leave the GDN states to the target's commit, and the tree-GDN kernel."""
    rb = random_bundle(0, family="qwen3_5", block_size=4)
    ar = weaver_jax.generate(rb, PROMPTS, max_new_tokens=16, eos_token_id=[])
    for method, options in HYBRID_METHODS:
        spec = weaver_jax.generate(rb, PROMPTS, method=method, max_new_tokens=16, eos_token_id=[], **options)
        assert spec.tokens == ar.tokens, method
    oracle = weaver_jax.Bundle(rb.target, drafter=OracleDrafter(rb.config, block_size=4, corrupt=True),
                               adapter=rb.adapter)
    with kernel_scope(("accept_commit", "tree_gdn")):
        spec = weaver_jax.generate(oracle, PROMPTS, method="weaver", max_new_tokens=16, eos_token_id=[],
                                   **dict(HYBRID_METHODS)["weaver"])
    assert spec.tokens == ar.tokens
    assert spec.stats["mean_accepted_length"] > 1.5, spec.stats  # paths past the root were folded


def test_hybrid_sampling_is_seed_identical_and_has_the_autoregressive_distribution():
    """Weaver: token for token `ar`'s samples for per-prompt seeds (ragged batch, top-k); dflash: 4000
    samples of 3 tokens against the exact distribution (vocabulary 4; the dense target's tests take 16000)."""
    rb = random_bundle(1, family="qwen3_5", block_size=4)
    sampling = dict(temperature=0.7, top_k=8, seed=[4, 2, 9], eos_token_id=[])
    ar = weaver_jax.generate(rb, PROMPTS, max_new_tokens=16, **sampling)
    spec = weaver_jax.generate(rb, PROMPTS, method="weaver", max_new_tokens=16, **sampling,
                               **dict(HYBRID_METHODS)["weaver"])
    assert spec.tokens == ar.tokens

    small = random_bundle(2, family="qwen3_5", vocab_size=4, num_layers=2, block_size=4)
    prompt, n = [1, 3, 0], 4_000
    exact = exact_three_token_distribution(small.target, prompt, temperature=1.0)
    out = weaver_jax.generate(small, [prompt] * n, method="dflash", max_new_tokens=3, eos_token_id=[],
                              seed=list(range(n)), temperature=1.0, pad_to=len(prompt))
    assert_three_token_distribution(out.tokens, exact)


def test_a_target_without_attention_layers():
    """All Gated DeltaNet (no K/V, so no slots to bound the cache): plain and speculative decoding still agree."""
    rb = random_bundle(3, family="qwen3_5", layer_types=("linear_attention", "linear_attention"), block_size=4)
    ar = weaver_jax.generate(rb, PROMPTS, max_new_tokens=6, eos_token_id=[])
    assert weaver_jax.generate(rb, PROMPTS, method="ddtree", budget=4, max_new_tokens=6, eos_token_id=[]).tokens \
        == ar.tokens
