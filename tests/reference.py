"""Independent float64 NumPy forward of a Llama / Qwen2 / Qwen3 decoder from Hugging Face-named
weights (Linear weights `[out, in]`), written from the architecture description."""

from __future__ import annotations

import math

import numpy as np


def random_hf_weights(cfg, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face names for a `weaver_jax.ModelConfig`."""
    rng = np.random.default_rng(seed)
    d, hd = cfg.hidden_size, cfg.head_dim

    def lin(out, inp):
        return (rng.standard_normal((out, inp)) / math.sqrt(inp)).astype(np.float32)

    def norm(n):
        return (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, d)).astype(np.float32) / 8,
         "model.norm.weight": norm(d)}
    if not cfg.tie_embeddings:
        w["lm_head.weight"] = lin(cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(cfg.num_heads * hd, d)
        w[p + "self_attn.k_proj.weight"] = lin(cfg.num_kv_heads * hd, d)
        w[p + "self_attn.v_proj.weight"] = lin(cfg.num_kv_heads * hd, d)
        w[p + "self_attn.o_proj.weight"] = lin(d, cfg.num_heads * hd)
        if cfg.qkv_bias:
            for n, h in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
                w[p + f"self_attn.{n}_proj.bias"] = (0.1 * rng.standard_normal(h * hd)).astype(np.float32)
        if cfg.qk_norm:
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = norm(hd), norm(hd)
        w[p + "mlp.gate_proj.weight"] = lin(cfg.intermediate_size, d)
        w[p + "mlp.up_proj.weight"] = lin(cfg.intermediate_size, d)
        w[p + "mlp.down_proj.weight"] = lin(d, cfg.intermediate_size)
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = norm(d), norm(d)
    return w


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _inv_freq(cfg):
    d = cfg.head_dim
    freqs = [cfg.rope_theta ** (-2 * i / d) for i in range(d // 2)]
    s = cfg.rope_scaling
    if s is None:
        return np.array(freqs)
    out = []
    for f in freqs:  # Llama 3.1 frequency scaling, case by case
        wavelen = 2 * math.pi / f
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            out.append(f)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return np.array(out)


def _rope(x, positions, inv_freq):  # x [T, H, D]; rotate_half convention
    ang = positions[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def forward(cfg, weights: dict[str, np.ndarray], ids, visible=None, positions=None):
    """Logits `[T, V]` and per-layer outputs of one sequence `ids [T]`.

    visible `[T, T]` bool (default causal): which tokens each token attends to.
    positions `[T]` (default 0..T-1)."""
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    t = len(ids)
    visible = np.tril(np.ones((t, t), bool)) if visible is None else visible
    positions = np.arange(t, dtype=np.float64) if positions is None else np.asarray(positions, np.float64)
    inv_freq = _inv_freq(cfg)
    h, kv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = _rms(x, w[p + "input_layernorm.weight"], eps)
        proj = {}
        for n in "qkv":
            y = a @ w[p + f"self_attn.{n}_proj.weight"].T
            if cfg.qkv_bias:
                y = y + w[p + f"self_attn.{n}_proj.bias"]
            proj[n] = y.reshape(t, -1, hd)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if cfg.qk_norm:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, positions, inv_freq), _rope(k, positions, inv_freq)
        out = np.zeros((t, h, hd))
        for head in range(h):
            kh = head // (h // kv)
            s = q[:, head] @ k[:, kh].T / math.sqrt(hd)
            s = np.where(visible, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kh]
        x = x + out.reshape(t, h * hd) @ w[p + "self_attn.o_proj.weight"].T
        m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g = m @ w[p + "mlp.gate_proj.weight"].T
        u = m @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
        layers.append(x)
    head = w["model.embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    return _rms(x, w["model.norm.weight"], eps) @ head.T, layers
