"""Published Weaver adapter checkpoints -> `weaver_jax.Adapter`.

The published format is one `torch.save` file holding `{"config": {...}, "state_dict": {...}}`
(optionally `"metadata": {"speculator_kind": "dflash_tfm_weaver"}`). Config fields: d_model,
d_embed, d_rank, num_layers, num_heads, mlp_dim, K, candidate_pool_size, rope_base (10000 when
absent). Tensors (PyTorch `[out, in]` weights, transposed here):

    embed_norm.{weight,bias}      output_norm.{weight,bias}      out_norm.{weight,bias}
    token_in.{weight,bias}        proposal_in.{weight,bias}      lm_head_query_in.weight
    blocks.{i}.norm_attn.{weight,bias}   blocks.{i}.qkv_proj.weight   blocks.{i}.o_proj.weight
    blocks.{i}.norm_mlp.{weight,bias}    blocks.{i}.gate_up_proj.{weight,bias}
    blocks.{i}.down_proj.{weight,bias}

RMSNorms there are `x / rms(x) * weight + bias` with eps 1e-6; attention heads all have their own
K/V (no grouping); the MLP is SwiGLU with gate first in `gate_up_proj`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from flax import nnx

from weaver_jax._adapter import Adapter, AdapterConfig
from weaver_jax._model import module_from_params
from weaver_jax.convert.hf import check_all_used, tensor_getter

REQUIRED = ("d_model", "d_embed", "d_rank", "num_layers", "num_heads", "mlp_dim", "K", "candidate_pool_size")
# Fields the published config may carry, with the only values this implementation follows.
FIXED = {"activation": "swiglu", "encoder_mode": 3, "score_head": 4}
EPS = 1e-6


def adapter_config_from_published(cfg: Mapping, dtype: str = "float32") -> AdapterConfig:
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"Weaver config lacks {missing}")
    for key, value in FIXED.items():
        if key in cfg and cfg[key] != value:
            raise ValueError(f"unsupported Weaver variant: {key}={cfg[key]!r} (this implementation follows {value!r})")
    unknown = sorted(set(cfg) - set(REQUIRED) - set(FIXED) - {"rope_base"})
    if unknown:
        raise ValueError(f"unknown Weaver config fields {unknown}")
    return AdapterConfig(**{k: int(cfg[k]) for k in REQUIRED}, rope_base=float(cfg.get("rope_base", 10_000.0)),
                         rms_norm_eps=EPS, dtype=dtype)


def adapter_params_from_published(config: AdapterConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    get, used = tensor_getter(tensors)
    out = {}
    for src, dst in (("embed_norm", "embed_norm"), ("output_norm", "output_norm"), ("out_norm", "out_norm")):
        out[dst], out[f"{dst}_bias"] = get(f"{src}.weight"), get(f"{src}.bias")
    for name in ("token_in", "proposal_in"):
        out[name], out[f"{name}_bias"] = get(f"{name}.weight").T, get(f"{name}.bias")
    out["query"] = get("lm_head_query_in.weight").T
    for i in range(config.num_layers):
        src, dst = f"blocks.{i}.", f"layers.{i}."
        out[dst + "attn_norm"], out[dst + "attn_norm_bias"] = get(src + "norm_attn.weight"), get(src + "norm_attn.bias")
        out[dst + "attn.qkv"] = get(src + "qkv_proj.weight").T
        out[dst + "attn.out"] = get(src + "o_proj.weight").T
        out[dst + "mlp_norm"], out[dst + "mlp_norm_bias"] = get(src + "norm_mlp.weight"), get(src + "norm_mlp.bias")
        out[dst + "mlp.gate_up"], out[dst + "mlp.gate_up_bias"] = (get(src + "gate_up_proj.weight").T,
                                                                   get(src + "gate_up_proj.bias"))
        out[dst + "mlp.down"], out[dst + "mlp.down_bias"] = get(src + "down_proj.weight").T, get(src + "down_proj.bias")
    check_all_used(tensors, used)
    return out


def load_published_adapter(path: str | Path, dtype: str = "float32", progress: bool = False) -> Adapter:
    """A published Weaver adapter file -> Adapter (shapes checked against its config)."""
    from tqdm import tqdm

    from weaver_jax.convert import torch_pickle

    payload = torch_pickle.load(path)
    if not isinstance(payload, dict) or "config" not in payload or "state_dict" not in payload:
        raise ValueError(f"{path}: a Weaver adapter file holds a dict with 'config' and 'state_dict'")
    kind = (payload.get("metadata") or {}).get("speculator_kind")
    if kind not in (None, "dflash_tfm_weaver"):
        raise ValueError(f"{path}: metadata.speculator_kind is {kind!r}, not a Weaver adapter ('dflash_tfm_weaver')")
    config = adapter_config_from_published(payload["config"], dtype)
    state = payload["state_dict"]
    tensors = {k: np.asarray(state[k], np.float32) for k in tqdm(list(state), unit="tensor", disable=not progress)}
    params = adapter_params_from_published(config, tensors)
    return module_from_params(lambda: Adapter(config, rngs=nnx.Rngs(0)), config.dtype, params)
