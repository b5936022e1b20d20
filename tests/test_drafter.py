"""The DFlash drafter against an independent float64 NumPy forward, and its context cache."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import weaver_jax
from weaver_jax._drafter import Drafter, default_target_layer_ids, random_drafter_config
from weaver_jax._model import module_params

from .conftest import make_pair


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, theta):  # x [T, H, D], rotate_half convention
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    return x * cos + np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def reference_drafter(drafter: Drafter, target_hidden: list[np.ndarray], block_embeds: np.ndarray) -> np.ndarray:
    """One sequence: context = every token of target_hidden (positions 0..C-1), block after it."""
    c = drafter.config
    p = {k: np.asarray(v, np.float64) for k, v in module_params(drafter).items()}
    feats = _rms(np.concatenate(target_hidden, -1) @ p["fc"], p["hidden_norm"], c.rms_norm_eps)
    n_ctx, n_blk = feats.shape[0], block_embeds.shape[0]
    x = np.asarray(block_embeds, np.float64)
    pos_ctx, pos_blk = np.arange(n_ctx, dtype=np.float64), n_ctx + np.arange(n_blk, dtype=np.float64)
    h, kv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    for i in range(c.num_layers):
        lp = f"layers.{i}."
        wq, wk, wv = np.split(p[lp + "attn.qkv"], [h * hd, (h + kv) * hd], axis=1)
        a = _rms(x, p[lp + "attn_norm"], c.rms_norm_eps)
        q = _rms((a @ wq).reshape(n_blk, h, hd), p[lp + "attn.q_norm"], c.rms_norm_eps)
        k_blk = _rms((a @ wk).reshape(n_blk, kv, hd), p[lp + "attn.k_norm"], c.rms_norm_eps)
        k_ctx = _rms((feats @ wk).reshape(n_ctx, kv, hd), p[lp + "attn.k_norm"], c.rms_norm_eps)
        q = _rope(q, pos_blk, c.rope_theta)
        k = np.concatenate([_rope(k_ctx, pos_ctx, c.rope_theta), _rope(k_blk, pos_blk, c.rope_theta)])
        v = np.concatenate([(feats @ wv).reshape(n_ctx, kv, hd), (a @ wv).reshape(n_blk, kv, hd)])
        out = np.zeros((n_blk, h, hd))
        for head in range(h):  # no mask: the block sees the context and all of itself
            s = q[:, head] @ k[:, head // (h // kv)].T / math.sqrt(hd)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, head // (h // kv)]
        x = x + out.reshape(n_blk, h * hd) @ p[lp + "attn.out"]
        m = _rms(x, p[lp + "mlp_norm"], c.rms_norm_eps)
        g, u = np.split(m @ p[lp + "mlp.gate_up"], 2, axis=-1)
        x = x + (g / (1 + np.exp(-g)) * u) @ p[lp + "mlp.down"]
    return _rms(x, p["final_norm"], c.rms_norm_eps)


def randomise(module, seed):
    """Norm scales away from 1 so that every weight matters."""
    rng = np.random.default_rng(seed)
    for path, param in nnx.iter_graph(module):
        if isinstance(param, nnx.Param) and "norm" in str(path[-1]):
            param[...] = jnp.asarray(1 + 0.2 * rng.standard_normal(param.shape), param.dtype)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_drafter_matches_reference_and_context_grows_incrementally(family):
    cfg, _, target = make_pair(family, seed=3)
    drafter = Drafter(random_drafter_config(cfg, num_layers=2, block_size=5), rngs=nnx.Rngs(1))
    randomise(drafter, 2)
    rng = np.random.default_rng(4)
    ctx_len = 9
    ids = rng.integers(0, cfg.vocab_size, (1, ctx_len))
    out = target(jnp.asarray(ids), jnp.arange(ctx_len)[None], weaver_jax.KVCache.init(cfg, 1, 16),
                 hidden_layers=drafter.config.target_layer_ids)
    block = np.concatenate([[5], [drafter.config.mask_token_id] * 4])
    embeds = jnp.take(target.embed[...], jnp.asarray(block)[None], axis=0)

    whole = drafter.commit(drafter.init_cache(1, 32), out.hidden, jnp.arange(ctx_len)[None], jnp.array([ctx_len]))
    states = np.asarray(drafter(embeds, whole))[0]
    ref = reference_drafter(drafter, [np.asarray(h[0], np.float64) for h in out.hidden], np.asarray(embeds[0]))
    np.testing.assert_allclose(states, ref, atol=1e-4)

    # the same context committed in two ragged pieces (padding past num_new is never seen)
    cache = drafter.init_cache(1, 32)
    first = tuple(jnp.pad(h[:, :4], ((0, 0), (0, 3), (0, 0)), constant_values=99.0) for h in out.hidden)
    cache = drafter.commit(cache, first, jnp.arange(7)[None], jnp.array([4]))
    rest = tuple(h[:, 4:] for h in out.hidden)
    cache = drafter.commit(cache, rest, jnp.arange(4, ctx_len)[None], jnp.array([ctx_len - 4]))
    assert int(cache.lengths[0]) == ctx_len
    np.testing.assert_allclose(np.asarray(drafter(embeds, cache))[0], states, atol=1e-5)


def test_drafter_of_another_width_uses_projections():
    cfg, _, target = make_pair("llama_tied", seed=5)
    drafter = Drafter(random_drafter_config(cfg, hidden_size=32, block_size=4), rngs=nnx.Rngs(0))
    assert drafter.in_proj is not None and drafter.out_proj is not None
    cache = drafter.init_cache(2, 16)
    logits, states = drafter.propose(target, None, jnp.array([3, 4]), cache)
    assert states.shape == (2, 3, cfg.hidden_size)
    assert logits.shape == (2, 3, cfg.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))


def test_default_target_layer_ids_follow_dflash():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(2, 2) == (0, 1)
