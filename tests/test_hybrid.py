"""The hybrid (Qwen3.5-style) target: decoding token by token equals one prefill of the whole
sequence (ragged batch); every node of a verified tree has the logits of the prefill of its own path,
and committing a path leaves the cache (K/V and GDN states) a prefill of that path leaves."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from weaver_jax._hybrid import random_hybrid

from .test_pallas_row_invariant import random_paths

TOL = dict(rtol=1e-4, atol=1e-4)
prefill = nnx.jit(lambda model, tokens, cache, lengths: model.prefill(tokens, cache, lengths))
verify = nnx.jit(lambda model, tokens, depth, cache, ancestors: model.verify(tokens, depth, cache, ancestors))
commit = nnx.jit(lambda model, cache, pending, path, length: model.commit(cache, pending, path, length))


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


def test_qwen3_5_logits_match_transformers():
    """A tiny random Qwen3.5 text model made by transformers (tests/fixtures/make_fixtures.py): converted,
    its logits equal transformers' (float32: measured 2e-7 apart at logits of std 0.16; the tolerance leaves
    float32 rounding through 4 layers 50x room); a missing or an extra tensor is named."""
    import json
    from pathlib import Path

    import pytest

    from weaver_jax.convert.hf import hybrid_config_from_hf, hybrid_params_from_hf, load_hf_hybrid, read_weights

    directory = Path(__file__).parent / "fixtures" / "hf" / "qwen3_5"
    model = load_hf_hybrid(directory)
    ref = np.load(directory / "reference.npz")
    ids = jnp.asarray(ref["ids"])
    logits, _ = prefill(model, ids, model.init_cache(*ids.shape), jnp.full((ids.shape[0],), ids.shape[1]))
    np.testing.assert_allclose(logits, ref["logits"], rtol=1e-4, atol=1e-5)
    tensors = read_weights(directory)
    config = hybrid_config_from_hf(json.loads((directory / "config.json").read_text()))
    with pytest.raises(ValueError, match="missing tensor model.layers.0.linear_attn.A_log"):
        hybrid_params_from_hf(config, {n: t for n, t in tensors.items() if n != "model.layers.0.linear_attn.A_log"})
    with pytest.raises(ValueError, match="unexpected tensors: .*extra"):
        hybrid_params_from_hf(config, {**tensors, "model.extra.weight": tensors["model.norm.weight"]})
