"""Tree attention: the Pallas kernel (interpret mode on a CPU, compiled on a GPU) equals the masked-softmax reference on
fresh random inputs, with outputs poisoned so unwritten elements fail; and it lowers for CUDA
(Triton) at the shapes the library uses, so an operation Triton rejects fails here, not on a GPU."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weaver_jax._tree import Tree
from weaver_jax.pallas_kernels import interpret
from weaver_jax.pallas_kernels.tree_attention import (
    rope_table,
    tree_attention,
    tree_attention_from_qkv,
    tree_attention_from_qkv_reference,
    tree_attention_reference,
)

from .cuda import lower_for_cuda


def random_ancestors(rng, batch, nodes, padding):
    """A random tree per row (parents before children) whose last `padding` nodes are invalid."""
    parent = np.full((batch, nodes), -1)
    for r in range(batch):
        for i in range(1, nodes):
            parent[r, i] = rng.integers(0, i)
    valid = np.arange(nodes)[None, :] < nodes - padding
    return Tree(jnp.zeros((batch, nodes), jnp.int32), jnp.asarray(parent, jnp.int32),
                jnp.zeros((batch, nodes), jnp.int32), jnp.asarray(np.broadcast_to(valid, (batch, nodes)))).ancestors()


CASES = [  # batch, nodes, query heads, kv heads (GQA ratio 1 / 3 / 4 / 8), head dim, cache slots, padding nodes,
    # tile options ({}: the defaults, prefix splits capped by the cache's key blocks)
    (1, 1, 4, 4, 16, 64, 0, {}),
    (2, 5, 9, 3, 32, 80, 1, dict(splits=3)),
    (3, 17, 16, 4, 16, 200, 4, dict(splits=5)),  # cache size not a multiple of 16
    (1, 256, 8, 1, 16, 512, 30, dict(splits=3)),
    (2, 20, 8, 2, 16, 1000, 2, dict(splits=20)),  # a cache much longer than most prefixes; the merge reads 2 x 16
    # J = 10 launched, each sequence using 5 (`least`) to 10, one per 64 keys of its length: the idle splits'
    # partials stay unwritten (poisoned), so a merge that read them would fail
    (3, 20, 8, 2, 16, 1000, 2, dict(block_r=16, programs=300)),
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case):
    b, n, h, kv, d, s, padding, options = case
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.float32)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray(rng.integers(0, s - n + 1, b), jnp.int32)  # ragged, any alignment, 0 allowed
    ancestors = random_ancestors(rng, b, n, padding)
    out = tree_attention(q, k_cache, v_cache, lengths, ancestors, block_k=16, **options, interpret=interpret(),
                         poison=True)
    ref = jax.jit(tree_attention_reference)(q, k_cache, v_cache, lengths, ancestors)  # one compile, not one per op
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5, err_msg=f"seed {seed}")


def test_bfloat16_inputs_accumulate_in_float32():
    """bf16 in, bf16 out, within bf16 rounding of the float32 reference."""
    rng = np.random.default_rng()
    b, n, h, kv, d, s = 2, 8, 8, 2, 32, 96
    q = jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.bfloat16)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.bfloat16) for _ in range(2))
    lengths, ancestors = jnp.array([40, 88]), random_ancestors(rng, b, n, 2)
    out = tree_attention(q, k_cache, v_cache, lengths, ancestors, block_k=16, splits=2, interpret=interpret(),
                         poison=True)
    assert out.dtype == jnp.bfloat16
    ref = jax.jit(tree_attention_reference)(q.astype(jnp.float32), *(c.astype(jnp.float32) for c in (k_cache, v_cache)),
                                            lengths, ancestors)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2)


@pytest.mark.parametrize("case", [  # batch, nodes, query / kv heads, head dim, cache slots, padding, q/k norm eps,
    # options; lengths up to 2 past the last that fits: rows past the cache are dropped and unseen
    (2, 5, 8, 2, 16, 40, 1, 1e-6, dict(splits=3)), (1, 1, 4, 4, 32, 64, 0, None, {}),
    (3, 17, 8, 4, 16, 60, 3, 1e-6, dict(splits=2, block_r=16))])
def test_attention_from_qkv_matches_norm_rotate_write_attend(case):
    """The fused form (norms, rotation and cache writes inside the partials kernel) equals the model's steps in
    XLA (`tree_attention_from_qkv_reference`): the output and both caches, fresh random inputs, outputs poisoned."""
    b, n, h, kv, d, s, padding, eps, options = case
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((b, n, (h + 2 * kv) * d)), jnp.float32)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray(rng.integers(0, s - n + 3, b), jnp.int32)
    rope = rope_table(lengths[:, None] + jnp.arange(n), 1.0 / 10000 ** (np.arange(0, d, 2) / d))
    q_norm, k_norm = (jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32) for _ in range(2))
    args = (qkv, rope, q_norm, k_norm, k_cache, v_cache, lengths, random_ancestors(rng, b, n, padding))
    want = jax.jit(tree_attention_from_qkv_reference, static_argnames=("heads", "eps"))(*args, heads=h, eps=eps)
    got = tree_attention_from_qkv(*args, heads=h, eps=eps, block_k=16, **options, interpret=interpret(), poison=True)
    for name, a, b_ in zip(("out", "k_cache", "v_cache"), got, want, strict=True):
        np.testing.assert_allclose(a, b_, atol=2e-5, rtol=2e-5, err_msg=f"{name}, seed {seed}")


LIBRARY_SHAPES = [  # Qwen3-8B (32 / 8 heads, dim 128) at N = 1 / 64 / 256, B = 1 / 8; SmolLM2 (9 / 3, dim 64)
    (1, 1, 32, 8, 128, 2048, jnp.bfloat16), (1, 64, 32, 8, 128, 4096, jnp.bfloat16),
    (8, 256, 32, 8, 128, 16384, jnp.bfloat16), (1, 65, 9, 3, 64, 512, jnp.float32),
    (32, 129, 9, 3, 64, 1024, jnp.bfloat16),
]


@pytest.mark.parametrize("shape, options", [(shape, {}) for shape in LIBRARY_SHAPES] + [
    (LIBRARY_SHAPES[1], dict(splits=8, block_r=128))])  # a bench sweep's: the merge masks unwritten columns
def test_lowers_for_cuda(shape, options):
    b, n, h, kv, d, s, dtype = shape
    args = [jax.ShapeDtypeStruct((b, n, h, d), dtype), jax.ShapeDtypeStruct((b, s, kv, d), dtype),
            jax.ShapeDtypeStruct((b, s, kv, d), dtype), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, n, n), jnp.bool_)]
    lower_for_cuda(tree_attention, *args, **options)
    if not options:  # the form from qkv (Qwen3's q / k norms)
        qkv = jax.ShapeDtypeStruct((b, n, (h + 2 * kv) * d), dtype)
        rope, norm = jax.ShapeDtypeStruct((b, n, 2, d), jnp.float32), jax.ShapeDtypeStruct((d,), dtype)
        lower_for_cuda(tree_attention_from_qkv, qkv, rope, norm, norm, *args[1:], heads=h, eps=1e-6)


@pytest.mark.parametrize("method, options, temperature, search", [
    ("ar", {}, 0.0, None), ("dflash", {}, 0.0, None),  # (a DDTree round runs the same kernels as Weaver's)
    ("weaver", {"budget": 10}, 0.0, "kernels"), ("weaver", {"budget": 10}, 1.0, "xla")])
def test_generation_with_kernels_equals_without(method, options, temperature, search, monkeypatch):
    """The target's forward with the tree-attention kernel (prefill, decode steps and verification: up to 16 new
    tokens in the form that norms, rotates and writes the cache itself, more in the two-step form), the
    acceptance + commit kernel, and the Weaver search in its kernels (or, search "xla", in XLA
    with the adapter-attention kernel) emit the same tokens as the XLA paths (greedy, and sampled
    with the same key), and the kernels are really traced in."""
    import weaver_jax
    from weaver_jax.pallas_kernels import KERNELS, kernel_scope
    from weaver_jax.pallas_kernels import accept_commit as accept_module
    from weaver_jax.pallas_kernels import adapter_attention as adapter_module
    from weaver_jax.pallas_kernels import tree_attention as module
    from weaver_jax.pallas_kernels import weaver_search as search_module
    from weaver_jax.testing import random_bundle

    calls, fused_calls, accepts, adapters, searches = [], [], [], [], []
    # prefill (a padded chunk) takes the two-step form; decode steps and these trees (up to 11 nodes) the fused
    # form, but for the "xla" case's trees (`FROM_QKV_MAX_NODES` lowered to decode steps, which Weaver has none of)
    if search == "xla":
        from weaver_jax import _model

        monkeypatch.setattr(_model, "FROM_QKV_MAX_NODES", 1)
    for owner, name, log in ((module, "tree_attention", calls), (module, "tree_attention_from_qkv", fused_calls),
                             (accept_module, "accept_commit", accepts),
                             (adapter_module, "adapter_attention", adapters),
                             (search_module, "weaver_search", searches)):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, original=original, log=log, **k: log.append(1) or original(*a, **k))
    bundle = random_bundle(5, vocab_size=64, block_size=5)
    assert search_module.fits(bundle.adapter.config)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    outputs = []
    for on in (False, True):
        kernels = tuple(k for k in KERNELS if search != "xla" or k != "weaver_search") if on else ()
        with kernel_scope(kernels):
            outputs.append(weaver_jax.generate(bundle, prompts, method=method, max_new_tokens=10, eos_token_id=[],
                                               temperature=temperature, top_k=20 if temperature else 0, seed=3,
                                               **options).tokens)
        assert bool(calls) == on and bool(fused_calls) == (on and search != "xla")
        assert bool(accepts) == (on and method != "ar")
        assert bool(adapters) == (on and search == "xla")
        assert bool(searches) == (on and search == "kernels")
    assert outputs[0] == outputs[1]


def test_switch_default_and_environment(monkeypatch):
    """By default only the measured kernels, and only on a GPU backend; WEAVER_JAX_KERNELS or
    use_kernels forces all of them on or off; a scope wins over both; typos are errors."""
    import weaver_jax.pallas_kernels as kernels
    from weaver_jax.pallas_kernels import KERNELS, MEASURED, enabled_kernels, kernel_scope, kernels_enabled, use_kernels

    monkeypatch.delenv("WEAVER_JAX_KERNELS", raising=False)
    assert enabled_kernels() == (MEASURED if jax.default_backend() == "gpu" else ())
    monkeypatch.setattr(kernels.jax, "default_backend", lambda: "gpu")
    assert enabled_kernels() == MEASURED and all(kernels_enabled(k) == (k in MEASURED) for k in KERNELS)
    for flag, on in (("1", KERNELS), ("0", ())):
        monkeypatch.setenv("WEAVER_JAX_KERNELS", flag)
        assert enabled_kernels() == on
    use_kernels(True)
    try:
        assert enabled_kernels() == KERNELS
        with kernel_scope(()):
            assert not kernels_enabled("tree_attention")
    finally:
        use_kernels(None)
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels_enabled("flash")
    with pytest.raises(ValueError, match="unknown kernels"), kernel_scope(("flash",)):
        pass
    monkeypatch.setenv("WEAVER_JAX_KERNELS", "tree_attention, tree_gdn")
    assert enabled_kernels() == ("tree_attention", "tree_gdn")
    monkeypatch.setenv("WEAVER_JAX_KERNELS", "yes")
    with pytest.raises(ValueError, match="WEAVER_JAX_KERNELS must be 0, 1 or a comma-separated list"):
        enabled_kernels()
