"""The project's checkpoint directory: `config.json` + orbax parameters (+ `tokenizer.json`).

    DST/config.json      {"format": "weaver_jax", "version": 1, "target": {...ModelConfig...}}
    DST/target/          orbax checkpoint of the target's parameters, names as `flatten_params`
    DST/tokenizer.json   the tokenizer's vocabulary, merges and chat template, when the source had one

Writing goes to a temporary sibling directory renamed into place at the end, so a failed
conversion never leaves a half-written DST.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from flax import nnx

from weaver_jax._config import ModelConfig
from weaver_jax._model import Transformer, flatten_params, target_from_params
from weaver_jax._tokenizer import Tokenizer

FORMAT, VERSION = "weaver_jax", 1


def is_checkpoint(path: Path) -> bool:
    config = Path(path) / "config.json"
    return config.exists() and json.loads(config.read_text()).get("format") == FORMAT


def save(dst: str | Path, target: Transformer, tokenizer: Tokenizer | None = None) -> Path:
    import orbax.checkpoint as ocp

    dst = Path(dst).absolute()
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new destination")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        params = flatten_params(nnx.to_pure_dict(nnx.state(target)))
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp / "target", params)
        config = {"format": FORMAT, "version": VERSION, "target": target.config.to_dict()}
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        if tokenizer is not None:
            (tmp / "tokenizer.json").write_text(json.dumps(tokenizer.spec))
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def load(path: str | Path, dtype: str | None = None) -> tuple[Transformer, Tokenizer | None]:
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    config = json.loads((path / "config.json").read_text())
    if config.get("version") != VERSION:
        raise ValueError(f"{path}: checkpoint version {config.get('version')} is not supported (expected {VERSION})")
    target_config = ModelConfig.from_dict(config["target"])
    if dtype is not None:
        target_config = target_config.replace(dtype=dtype)
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(path / "target")
    target = target_from_params(target_config, {k: np.asarray(v) for k, v in params.items()})
    tokenizer_file = path / "tokenizer.json"
    tokenizer = Tokenizer.from_spec(json.loads(tokenizer_file.read_text())) if tokenizer_file.exists() else None
    return target, tokenizer
