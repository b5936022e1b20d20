"""Hugging Face checkpoints -> weaver_jax targets: config translation and one explicit key map."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from weaver_jax._config import ModelConfig, RopeScaling
from weaver_jax._model import target_from_params

FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def config_from_hf(cfg: Mapping, dtype: str = "float32") -> ModelConfig:
    """Translate a Hugging Face `config.json` dict (Llama / Qwen2 / Qwen3)."""
    archs = cfg.get("architectures") or []
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    if family is None:
        raise ValueError(f"unsupported architecture {archs}; supported: {sorted(FAMILIES) + list(HYBRID_FAMILIES)}")
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    rope_scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        rope_scaling = RopeScaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                   float(scaling["high_freq_factor"]),
                                   int(scaling["original_max_position_embeddings"]))
    elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {scaling}")
    rope_theta = cfg.get("rope_theta", (scaling or {}).get("rope_theta", 10_000.0))
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(rope_theta), rope_scaling=rope_scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3", max_seq_len=int(cfg.get("max_position_embeddings", 8192)),
        dtype=dtype, family=family)


def target_params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensor names (Linear weights `[out, in]`) -> the project's flat names (`[in, out]`,
    fused qkv and gate/up). Raises on missing or unexpected tensors, naming them."""
    get, used = tensor_getter(tensors)
    out = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight")}
    if config.tie_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints still store a copy
    else:
        out["lm_head"] = get("lm_head.weight").T
    for i in range(config.num_layers):
        out.update(block_params(get, f"model.layers.{i}.", f"layers.{i}.", config.qkv_bias, config.qk_norm))
    check_all_used(tensors, used)
    return out


def block_params(get, src: str, dst: str, qkv_bias: bool, qk_norm: bool) -> dict[str, np.ndarray]:
    """One HF decoder layer (`src` prefix) -> the project's `Block` (`dst` prefix)."""
    out = {dst + "attn.qkv": np.concatenate([get(f"{src}self_attn.{n}_proj.weight") for n in "qkv"], axis=0).T}
    if qkv_bias:
        out[dst + "attn.qkv_bias"] = np.concatenate([get(f"{src}self_attn.{n}_proj.bias") for n in "qkv"])
    if qk_norm:
        out[dst + "attn.q_norm"] = get(src + "self_attn.q_norm.weight")
        out[dst + "attn.k_norm"] = get(src + "self_attn.k_norm.weight")
    out[dst + "attn.out"] = get(src + "self_attn.o_proj.weight").T
    gate_up = [get(src + "mlp.gate_proj.weight"), get(src + "mlp.up_proj.weight")]
    out[dst + "mlp.gate_up"] = np.concatenate(gate_up, axis=0).T
    out[dst + "mlp.down"] = get(src + "mlp.down_proj.weight").T
    out[dst + "attn_norm"] = get(src + "input_layernorm.weight")
    out[dst + "mlp_norm"] = get(src + "post_attention_layernorm.weight")
    return out


def tensor_getter(tensors: Mapping[str, np.ndarray]):
    """`get(name)` that names a missing tensor, and the set of names it handed out."""
    used: set[str] = set()

    def get(name):
        if name not in tensors:
            raise ValueError(f"missing tensor {name}")
        used.add(name)
        return np.asarray(tensors[name])

    return get, used


def check_all_used(tensors: Mapping[str, np.ndarray], used: set[str]) -> None:
    unexpected = sorted(n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"unexpected tensors: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")


def _weight_files(directory: Path, name: str) -> list[str]:
    """The shards named by `name.index.json`, or `[name]`, or [] when neither is in `directory`."""
    index = directory / f"{name}.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [name] if (directory / name).exists() else []


def read_safetensors(directory: Path, progress: bool = False) -> dict[str, np.ndarray]:
    """All tensors of `model.safetensors` or a sharded `model.safetensors.index.json`, as float32."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = _weight_files(directory, "model.safetensors")
    if not files:
        raise FileNotFoundError(f"{directory} holds no model.safetensors or model.safetensors.index.json")
    tensors = {}
    for f in files:
        try:
            with safe_open(directory / f, framework="numpy") as handle:
                for name in tqdm(list(handle.keys()), desc=f, unit="tensor", disable=not progress):
                    tensors[name] = handle.get_tensor(name).astype(np.float32)
        except Exception as e:  # OSError, or safetensors' own SafetensorError
            raise ValueError(f"cannot read {directory / f} (truncated or not safetensors?): {e}") from e
    return tensors


def read_torch_weights(directory: Path, progress: bool = False) -> dict[str, np.ndarray]:
    """All tensors of `pytorch_model.bin`, a sharded `pytorch_model.bin.index.json`, or the one
    `.pth` / `.pt` file of a directory, as float32 (weights-only loading, see torch_pickle)."""
    from tqdm import tqdm

    from weaver_jax.convert import torch_pickle

    files = _weight_files(directory, "pytorch_model.bin")
    if not files:
        files = sorted(p.name for p in directory.iterdir() if p.suffix in (".pth", ".pt"))
        if len(files) != 1:
            raise FileNotFoundError(f"{directory} holds no model.safetensors, pytorch_model.bin or single .pth file")
    tensors = {}
    for f in files:
        state = torch_pickle.load(directory / f)
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        if not isinstance(state, dict):
            raise ValueError(f"{directory / f} does not hold a state dict (got {type(state).__name__})")
        for name in tqdm(list(state), desc=f, unit="tensor", disable=not progress):
            tensors[name] = np.asarray(state[name], np.float32)
    return tensors


def read_weights(directory: Path, progress: bool = False) -> dict[str, np.ndarray]:
    """A Hugging Face directory's tensors: safetensors when present, else PyTorch pickles."""
    if _weight_files(directory, "model.safetensors"):
        return read_safetensors(directory, progress)
    return read_torch_weights(directory, progress)


def load_hf_target(directory: str | Path, dtype: str = "float32", progress: bool = False):
    """A Hugging Face directory -> `Transformer` (Llama / Qwen2 / Qwen3), or `HybridTransformer` (Qwen3.5)."""
    directory = Path(directory)
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"{directory} has no config.json: not a Hugging Face model directory")
    cfg = json.loads((directory / "config.json").read_text())
    if set(cfg.get("architectures") or []) & set(HYBRID_FAMILIES):
        return load_hf_hybrid(directory, dtype, progress)
    config = config_from_hf(cfg, dtype)
    tensors = read_weights(directory, progress)
    return target_from_params(config, target_params_from_hf(config, tensors))


HYBRID_FAMILIES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3NextForCausalLM")


def hybrid_config_from_hf(cfg: Mapping, dtype: str = "float32"):
    """Translate a Qwen3.5 `config.json` dict (the text model's, or a multimodal one's `text_config`)
    to a `HybridConfig`; `layer_types` as given, else full attention at every
    `full_attention_interval`-th layer (transformers' default schedule)."""
    from weaver_jax._hybrid import HybridConfig, qwen_layer_types

    text = cfg.get("text_config", cfg)
    layers = text["num_hidden_layers"]
    experts, step = text.get("num_experts", 0) or 0, text.get("decoder_sparse_step", 1) or 1
    sparse = [i for i in range(layers) if experts > 0 and i not in (text.get("mlp_only_layers") or [])
              and (i + 1) % step == 0]
    if sparse:
        raise ValueError(f"mixture-of-experts MLPs are not supported yet: layers {sparse} are sparse "
                         f"(num_experts={experts}); dense-MLP checkpoints (num_experts=0, or every layer in "
                         "mlp_only_layers) convert")
    types = tuple(text.get("layer_types") or qwen_layer_types(layers, text.get("full_attention_interval", 4)))
    if len(types) != layers:
        raise ValueError(f"layer_types lists {len(types)} layers for num_hidden_layers={layers}")
    rope = text.get("rope_parameters") or {}
    return HybridConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
        layer_types=types, num_heads=text["num_attention_heads"], num_kv_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"], linear_num_key_heads=text["linear_num_key_heads"],
        linear_num_value_heads=text["linear_num_value_heads"], linear_key_head_dim=text["linear_key_head_dim"],
        linear_value_head_dim=text["linear_value_head_dim"], linear_conv_kernel_dim=text["linear_conv_kernel_dim"],
        partial_rotary_factor=float(text.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))),
        rope_theta=float(text.get("rope_theta", rope.get("rope_theta", 10_000_000.0))),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(text.get("max_position_embeddings", 262_144)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))), dtype=dtype)


def hybrid_params_from_hf(config, tensors: Mapping[str, np.ndarray], prefix: str = "model.") -> dict[str, np.ndarray]:
    """Qwen3.5 tensor names -> `HybridTransformer`'s flat names (Linear weights transposed to `[in, out]`,
    the conv's `[C, 1, W]` to `[C, W]`, gate and up fused). Raises on missing or unexpected tensors."""
    get, used = tensor_getter(tensors)
    out = {"embed": get(prefix + "embed_tokens.weight"), "final_norm": get(prefix + "norm.weight")}
    if config.tie_embeddings:
        used.add("lm_head.weight")
    else:
        out["lm_head"] = get("lm_head.weight").T
    for i, kind in enumerate(config.layer_types):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        if kind == "full_attention":
            a = src + "self_attn."
            out.update({dst + "mixer.q_gate": get(a + "q_proj.weight").T, dst + "mixer.k": get(a + "k_proj.weight").T,
                        dst + "mixer.v": get(a + "v_proj.weight").T, dst + "mixer.out": get(a + "o_proj.weight").T,
                        dst + "mixer.q_norm": get(a + "q_norm.weight"), dst + "mixer.k_norm": get(a + "k_norm.weight")})
        else:
            g = src + "linear_attn."
            fused = g + "in_proj_qkvz.weight" in tensors  # Qwen3-Next: projections grouped by key head
            qkv, z, b, a = (unfuse_qwen3_next(config, get(g + "in_proj_qkvz.weight"), get(g + "in_proj_ba.weight"))
                            if fused else (get(g + "in_proj_qkv.weight"), get(g + "in_proj_z.weight"),
                                           get(g + "in_proj_b.weight"), get(g + "in_proj_a.weight")))
            out.update({dst + "mixer.in_qkv": qkv.T, dst + "mixer.in_z": z.T, dst + "mixer.in_b": b.T,
                        dst + "mixer.in_a": a.T,
                        dst + "mixer.conv": get(g + "conv1d.weight")[:, 0], dst + "mixer.A_log": get(g + "A_log"),
                        dst + "mixer.dt_bias": get(g + "dt_bias"), dst + "mixer.norm": get(g + "norm.weight"),
                        dst + "mixer.out": get(g + "out_proj.weight").T})
        out[dst + "mlp.gate_up"] = np.concatenate([get(src + "mlp.gate_proj.weight"),
                                                   get(src + "mlp.up_proj.weight")], axis=0).T
        out[dst + "mlp.down"] = get(src + "mlp.down_proj.weight").T
        out[dst + "input_norm"] = get(src + "input_layernorm.weight")
        out[dst + "mlp_norm"] = get(src + "post_attention_layernorm.weight")
    check_all_used({n: t for n, t in tensors.items() if not n.startswith(("mtp.", "model.visual."))}, used)
    return out


def unfuse_qwen3_next(config, qkvz: np.ndarray, ba: np.ndarray) -> tuple[np.ndarray, ...]:
    """Qwen3-Next's fused GDN input projections (torch `[out, in]`, output rows grouped by key head: per
    group q, k, then its value heads' v and z; b then a) -> Qwen3.5's separate ones (q of every head, k, v;
    z; b; a), value head j in key group j // (H_v / H_k) as before."""
    h_k, h_v = config.linear_num_key_heads, config.linear_num_value_heads
    d_k, d_v, r = config.linear_key_head_dim, config.linear_value_head_dim, h_v // h_k
    width = qkvz.shape[1]
    if qkvz.shape[0] != h_k * (2 * d_k + 2 * r * d_v) or ba.shape[0] != 2 * h_v:
        raise ValueError(f"in_proj_qkvz {qkvz.shape} / in_proj_ba {ba.shape} do not match {h_k} key heads of "
                         f"{d_k} and {h_v} value heads of {d_v}")
    q, k, v, z = np.split(qkvz.reshape(h_k, -1, width), np.cumsum([d_k, d_k, r * d_v]), axis=1)
    b, a = np.split(ba.reshape(h_k, 2 * r, width), 2, axis=1)
    rows = lambda x: x.reshape(-1, width)  # noqa: E731
    return np.concatenate([rows(q), rows(k), rows(v)]), rows(z), rows(b), rows(a)


def load_hf_hybrid(directory: str | Path, dtype: str = "float32", progress: bool = False):
    """A Qwen3.5 / Qwen3-Next Hugging Face directory -> `HybridTransformer` (shapes checked per tensor)."""
    from flax import nnx

    from weaver_jax._hybrid import HybridTransformer
    from weaver_jax._model import module_from_params

    directory = Path(directory)
    cfg = json.loads((directory / "config.json").read_text())
    if not set(cfg.get("architectures") or []) & set(HYBRID_FAMILIES):
        raise ValueError(f"not a Qwen3.5 / Qwen3-Next checkpoint: architectures {cfg.get('architectures')}")
    config = hybrid_config_from_hf(cfg, dtype)
    tensors = read_weights(directory, progress)
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in tensors) else "model."
    params = hybrid_params_from_hf(config, tensors, prefix)
    return module_from_params(lambda: HybridTransformer(config, rngs=nnx.Rngs(0)), config.jnp_dtype, params)
