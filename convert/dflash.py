"""DFlash drafter checkpoints (the published z-lab layout) -> `weaver_jax.Drafter`.

Layout: Qwen3 decoder layers `layers.{i}.*`, `fc.weight` (`[D, n * D]`), `hidden_norm.weight`,
`norm.weight`; config.json is a Qwen3 config with `block_size`, `mask_token_id` and
`target_layer_ids` at the top level or under `dflash_config` (layer ids default to DFlash's rule).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from flax import nnx

from weaver_jax._drafter import Drafter, DrafterConfig, default_target_layer_ids
from weaver_jax._model import module_from_params
from weaver_jax.convert.hf import block_params, check_all_used, read_weights, tensor_getter


def drafter_config_from_hf(cfg: Mapping, dtype: str = "float32", num_target_layers: int | None = None) -> DrafterConfig:
    extra = {**cfg, **(cfg.get("dflash_config") or {})}
    if "mask_token_id" not in extra or extra["mask_token_id"] is None:
        raise ValueError("DFlash config has no mask_token_id (top level or dflash_config)")
    layer_ids = extra.get("target_layer_ids")
    if layer_ids is None:
        if num_target_layers is None:
            raise ValueError("DFlash config has no target_layer_ids; pass the target's layer count "
                             "(--target-layers) for the default rule")
        layer_ids = default_target_layer_ids(num_target_layers, cfg["num_hidden_layers"])
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return DrafterConfig(
        target_hidden_size=d, vocab_size=cfg["vocab_size"], target_layer_ids=tuple(int(i) for i in layer_ids),
        hidden_size=d, intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads), head_dim=cfg.get("head_dim") or d // heads,
        block_size=int(extra.get("block_size", 16)), mask_token_id=int(extra["mask_token_id"]),
        rope_theta=float(cfg.get("rope_theta", 1_000_000.0)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        dtype=dtype)


def drafter_params_from_hf(config: DrafterConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    get, used = tensor_getter(tensors)
    out = {"fc": get("fc.weight").T, "hidden_norm": get("hidden_norm.weight"), "final_norm": get("norm.weight")}
    for i in range(config.num_layers):
        out.update(block_params(get, f"layers.{i}.", f"layers.{i}.", qkv_bias=False, qk_norm=True))
    check_all_used(tensors, used)
    return out


def drafter_from_params(config: DrafterConfig, params: dict) -> Drafter:
    return module_from_params(lambda: Drafter(config, rngs=nnx.Rngs(0)), config.dtype, params)


def load_dflash_drafter(directory: str | Path, dtype: str = "float32", progress: bool = False,
                        num_target_layers: int | None = None) -> Drafter:
    directory = Path(directory)
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"{directory} has no config.json: not a DFlash drafter directory")
    config = drafter_config_from_hf(json.loads((directory / "config.json").read_text()), dtype, num_target_layers)
    return drafter_from_params(config, drafter_params_from_hf(config, read_weights(directory, progress)))
