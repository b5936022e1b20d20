"""GGUF files -> weaver_jax targets and tokenizers.

Tensors are dequantized with the `gguf` package and renamed to Hugging Face names, so one key
map (`convert.hf`) serves both formats. llama.cpp's converter stores the llama architecture's
q/k projections permuted for interleaved rotation; RoPE here rotates split halves, so the
permutation is undone per head.
"""

from __future__ import annotations

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
    reader: object  # gguf.GGUFReader

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]


def open_gguf(path: str | Path) -> GGUFFile:
    """Read the header of a GGUF file; a truncated or malformed file raises ValueError."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
        metadata = {k: f.contents() for k, f in reader.fields.items()}
    except Exception as e:  # the gguf package raises assorted errors on bad files
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    return GGUFFile(path, metadata, reader)


def config_from_gguf(f: GGUFFile, dtype: str = "float32") -> ModelConfig:
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: unsupported GGUF architecture {arch!r}; supported: {list(ARCHITECTURES)}")
    m = f.metadata
    names = {t.name for t in f.reader.tensors}
    heads = int(m[f"{arch}.attention.head_count"])
    width = int(m[f"{arch}.embedding_length"])
    embed = next((t for t in f.reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError(f"{f.path}: missing tensor token_embd.weight")
    vocab = int(m.get(f"{arch}.vocab_size") or embed.shape[-1])
    return ModelConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=int(m[f"{arch}.feed_forward_length"]),
        num_layers=int(m[f"{arch}.block_count"]), num_heads=heads,
        num_kv_heads=int(m.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(m.get(f"{arch}.attention.key_length", width // heads)),
        rope_theta=float(m.get(f"{arch}.rope.freq_base", 10_000.0)),
        rms_norm_eps=float(m[f"{arch}.attention.layer_norm_rms_epsilon"]),
        tie_embeddings="output.weight" not in names, qkv_bias=arch == "qwen2",
        max_seq_len=int(m.get(f"{arch}.context_length", 8192)), dtype=dtype, family=arch)


def hf_tensors_from_gguf(f: GGUFFile, config: ModelConfig, progress: bool = False) -> dict[str, np.ndarray]:
    """Dequantized float32 tensors under Hugging Face names, q/k un-permuted for llama."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    out = {}
    for t in tqdm(f.reader.tensors, desc=f.path.name, unit="tensor", disable=not progress):
        name = hf_name(t.name)
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
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
