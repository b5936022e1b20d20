"""The project's checkpoint directory: `config.json` + orbax parameters (+ `tokenizer.json`).

    DST/config.json      {"format": "weaver_jax", "version": 1, "kind": "target" | "drafter" | "adapter",
                          "config": {...ModelConfig, HybridConfig, DrafterConfig or AdapterConfig...},
                          "architecture": "hybrid" for a Qwen3.5 target (absent otherwise)}
    DST/params/          orbax checkpoint of the module's parameters, names as `flatten_params`
    DST/tokenizer.json, tokenizer_config.json, generation_config.json
                         the tokenizer in Hugging Face's files (`Tokenizer.save`), when the source had one

Writing goes to a temporary sibling directory renamed into place at the end, so a failed
conversion never leaves a half-written DST.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from weaver_jax._adapter import Adapter, AdapterConfig
from weaver_jax._config import ModelConfig
from weaver_jax._drafter import Drafter, DrafterConfig
from weaver_jax._hybrid import HybridConfig, HybridTransformer
from weaver_jax._model import Transformer, flatten_params, module_from_params, module_params
from weaver_jax._tokenizer import Tokenizer

KINDS = {"target": (Transformer, ModelConfig), "drafter": (Drafter, DrafterConfig), "adapter": (Adapter, AdapterConfig)}
HYBRID = "hybrid"  # a target checkpoint's "architecture" when it is a `HybridTransformer` (Qwen3.5)

FORMAT, VERSION = "weaver_jax", 1


def is_checkpoint(path: Path) -> bool:
    config = Path(path) / "config.json"
    return config.exists() and json.loads(config.read_text()).get("format") == FORMAT


def kind_of(path: Path) -> str:
    return json.loads((Path(path) / "config.json").read_text()).get("kind")


def require_new(dst: str | Path) -> Path:
    dst = Path(dst).absolute()
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new destination")
    return dst


def save(dst: str | Path, module: Transformer | HybridTransformer | Drafter | Adapter,
         tokenizer: Tokenizer | None = None) -> Path:
    import orbax.checkpoint as ocp

    dst = require_new(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        params = module_params(module)
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp / "params", params)
        hybrid = isinstance(module, HybridTransformer)
        kind = "target" if hybrid else next(k for k, (cls, _) in KINDS.items() if isinstance(module, cls))
        config = {"format": FORMAT, "version": VERSION, "kind": kind, "config": dataclasses.asdict(module.config)}
        if hybrid:
            config["architecture"] = HYBRID
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        if tokenizer is not None:
            tokenizer.save(tmp)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def config_from_fields(config_cls, fields: dict):
    """A module config from its JSON fields (lists back to the tuples the configs hold)."""
    if config_cls is HybridConfig:
        return HybridConfig(**{**fields, "layer_types": tuple(fields["layer_types"])})
    if config_cls is ModelConfig:
        return ModelConfig.from_dict(fields)
    if config_cls is DrafterConfig:
        return DrafterConfig(**{**fields, "target_layer_ids": tuple(fields["target_layer_ids"])})
    return config_cls(**fields)


def load(path: str | Path, dtype: str | None = None) -> tuple[Transformer | Drafter | Adapter, Tokenizer | None]:
    """-> (the module, its tokenizer or None). dtype None keeps the stored parameter dtype."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = json.loads((path / "config.json").read_text())
    if meta.get("version") != VERSION or meta.get("kind") not in KINDS:
        raise ValueError(f"{path}: unsupported checkpoint (version {meta.get('version')}, kind {meta.get('kind')!r})")
    cls, config_cls = KINDS[meta["kind"]]
    if meta.get("architecture", "") not in ("", HYBRID):
        raise ValueError(f"{path}: unknown target architecture {meta['architecture']!r}")
    if meta.get("architecture") == HYBRID:
        cls, config_cls = HybridTransformer, HybridConfig
    config = stored = config_from_fields(config_cls, meta["config"])
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    # Restore onto this process's device: a checkpoint written on a GPU machine then loads on CPU.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {name: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device) for name, leaf in flatten_params(
        nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: cls(stored, rngs=nnx.Rngs(0)))))).items()}
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            params = checkpointer.restore(path / "params", abstract)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path}: the stored parameters do not match its {meta['kind']} config: {e}") from e
    module = module_from_params(lambda: cls(config, rngs=nnx.Rngs(0)), config.dtype,
                                {k: np.asarray(v) for k, v in params.items()})
    return module, Tokenizer.from_directory(path)
