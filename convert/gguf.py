"""GGUF files -> weaver_jax targets and tokenizers.

Tensors are dequantized with the `gguf` package and renamed to Hugging Face names, so one key
map (`convert.hf`) serves both formats. llama.cpp's converter stores the llama architecture's
q/k projections permuted for interleaved rotation; RoPE here rotates split halves, so the
permutation is undone per head.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weaver_jax._config import ModelConfig
from weaver_jax._model import Transformer, target_from_params
from weaver_jax.convert.hf import target_params_from_hf

ARCHITECTURES = ("llama", "qwen2")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name}")


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving permutation of a q/k weight `[out, in]` (or bias `[out]`)."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


@dataclass
class GGUFFile:
    path: Path
    metadata: dict
    tensor_shapes: dict[str, tuple[int, ...]]  # as the file lists them: innermost dimension first
    tensor_places: dict  # name -> (its gguf.GGMLQuantizationType, the offset of its data in the file)

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    @functools.cached_property
    def _bytes(self) -> np.ndarray:
        return np.memmap(self.path, np.uint8, mode="r")

    def tensor_data(self, name: str) -> np.ndarray:
        """A tensor's stored data, as `gguf.quants.dequantize` takes it (a view of the file, outermost dimension
        first): elements of a plain type (F32, F16, ...), or each row's bytes of a quantized one - what gguf's
        reader gives, without its ~4-7 s of parsing the header into numpy views of every vocabulary entry."""
        from gguf.quants import quant_shape_to_byte_shape

        kind, offset = self.tensor_places[name]
        shape = tuple(reversed(self.tensor_shapes[name]))
        data = self._bytes[offset: offset + _data_bytes(kind, shape)]
        if kind.name in _PLAIN_TYPES:
            return data.view(_PLAIN_TYPES[kind.name]).reshape(shape)
        return data.reshape(quant_shape_to_byte_shape(shape, kind))


_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


def _data_bytes(kind, shape: tuple[int, ...]) -> int:
    """The bytes of a tensor of this GGML type and shape: whole quantization blocks."""
    from gguf.constants import GGML_QUANT_SIZES

    block, block_bytes = GGML_QUANT_SIZES[kind]
    return int(np.prod(shape)) * block_bytes // block


# GGUF value types -> struct formats (little-endian); 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_header(path: Path) -> tuple[dict, dict[str, tuple[int, ...]], dict]:
    """(metadata, tensor shapes, tensor places) from a GGUF's header (`GGUFFile`'s fields), and a check that every
    tensor's data lies within the file. gguf.GGUFReader makes numpy views of every array element while it opens a
    file: ~7 s for a 150K-token vocabulary and its merges, where this plain walk takes ~0.3 s."""
    from gguf.constants import GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        offset = 0

        def take(fmt: str):
            nonlocal offset
            (value,) = struct.unpack_from(fmt, buf, offset)
            offset += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal offset
            n = take("<Q")
            offset += n
            return buf[offset - n : offset].decode("utf-8")

        def value(kind: int):
            nonlocal offset
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item, count = take("<I"), take("<Q")
                if item in _SCALARS:
                    dtype = np.dtype(_SCALARS[item].replace("?", "b1"))
                    items = np.frombuffer(buf, dtype, count, offset).tolist()
                    offset += dtype.itemsize * count
                    return items
                return [value(item) for _ in range(count)]
            return take(_SCALARS[kind])

        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic number")
        version, n_tensors, n_kv = take("<4xI"), take("<Q"), take("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
        metadata = {}
        for _ in range(n_kv):
            key = string()
            metadata[key] = value(take("<I"))
        shapes, places = {}, {}
        for _ in range(n_tensors):
            name, dims = string(), take("<I")
            if name in shapes:
                raise ValueError(f"tensor {name} listed twice")
            shapes[name] = tuple(take("<Q") for _ in range(dims))
            places[name] = take("<I"), take("<Q")  # GGML type, offset from the data's start
        alignment = int(metadata.get("general.alignment", 32))
        start = offset + -offset % alignment
        for name, (kind, at) in places.items():
            kind = GGMLQuantizationType(kind)
            end = start + at + _data_bytes(kind, shapes[name])
            if end > len(buf):
                raise ValueError(f"truncated: tensor {name}'s data ends at byte {end}, the file has {len(buf)}")
            places[name] = kind, start + at
    return metadata, shapes, places


def open_gguf(path: str | Path) -> GGUFFile:
    """Read the header of a GGUF file; a truncated or malformed file raises ValueError."""
    path = Path(path)
    try:
        metadata, shapes, places = read_header(path)
    except (ValueError, KeyError, IndexError, struct.error, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    return GGUFFile(path, metadata, shapes, places)


def config_from_gguf(f: GGUFFile, dtype: str = "float32") -> ModelConfig:
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: unsupported GGUF architecture {arch!r}; supported: {list(ARCHITECTURES)}")
    m = f.metadata
    heads = int(m[f"{arch}.attention.head_count"])
    width = int(m[f"{arch}.embedding_length"])
    if "token_embd.weight" not in f.tensor_shapes:
        raise ValueError(f"{f.path}: missing tensor token_embd.weight")
    vocab = int(m.get(f"{arch}.vocab_size") or f.tensor_shapes["token_embd.weight"][-1])
    return ModelConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=int(m[f"{arch}.feed_forward_length"]),
        num_layers=int(m[f"{arch}.block_count"]), num_heads=heads,
        num_kv_heads=int(m.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(m.get(f"{arch}.attention.key_length", width // heads)),
        rope_theta=float(m.get(f"{arch}.rope.freq_base", 10_000.0)),
        rms_norm_eps=float(m[f"{arch}.attention.layer_norm_rms_epsilon"]),
        tie_embeddings="output.weight" not in f.tensor_shapes, qkv_bias=arch == "qwen2",
        max_seq_len=int(m.get(f"{arch}.context_length", 8192)), dtype=dtype, family=arch)


def hf_tensors_from_gguf(f: GGUFFile, config: ModelConfig, progress: bool = False) -> dict[str, np.ndarray]:
    """Dequantized float32 tensors under Hugging Face names, q/k un-permuted for llama."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    out = {}
    for gguf_name, (kind, _) in tqdm(f.tensor_places.items(), desc=f.path.name, unit="tensor", disable=not progress):
        name = hf_name(gguf_name)
        w = np.asarray(dequantize(f.tensor_data(gguf_name), kind), np.float32)
        if f.architecture == "llama" and ".q_proj." in name:
            w = unpermute_rotary(w, config.num_heads)
        elif f.architecture == "llama" and ".k_proj." in name:
            w = unpermute_rotary(w, config.num_kv_heads)
        out[name] = w
    return out


def load_gguf_target(path: str | Path, dtype: str = "float32", progress: bool = False) -> Transformer:
    f = open_gguf(path)
    config = config_from_gguf(f, dtype)
    return target_from_params(config, target_params_from_hf(config, hf_tensors_from_gguf(f, config, progress)))
