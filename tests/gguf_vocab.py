"""Vocabulary-only GGUF files for tokenizer tests (needs only `gguf`; the fixture script imports it too).

`write_vocab_gguf` writes a GGUF with metadata and no tensors. `hf_vocab_metadata` turns a Hugging Face
`tokenizer.json` into the `tokenizer.ggml.*` fields the way llama.cpp's converter does for a byte-level BPE
(`_set_vocab_gpt2`): tokens in id order with gaps named `[PAD<id>]` (unused), added special tokens as control,
other added tokens as user defined, the merges as "left right" strings.
"""

import gzip
import shutil
from pathlib import Path

NORMAL, UNUSED, CONTROL, USER_DEFINED = 1, 5, 3, 4


def hf_vocab_metadata(tokenizer_json: dict, *, pre: str, bos: str | None, eos: str | None, add_bos: bool,
                      chat_template: str | None = None) -> dict:
    vocab = dict(tokenizer_json["model"]["vocab"])
    added = {t["content"]: t for t in tokenizer_json["added_tokens"]}
    vocab.update({t["content"]: t["id"] for t in added.values()})
    by_id = {i: t for t, i in vocab.items()}
    size = max(by_id) + 1
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [UNUSED if i not in by_id else (CONTROL if added[t]["special"] else USER_DEFINED) if t in added else NORMAL
             for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    m = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
         "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
         "tokenizer.ggml.add_bos_token": add_bos}
    if bos is not None:
        m["tokenizer.ggml.bos_token_id"] = vocab[bos]
    if eos is not None:
        m["tokenizer.ggml.eos_token_id"] = vocab[eos]
    if chat_template is not None:
        m["tokenizer.chat_template"] = chat_template
    return m


# Enough of a llama architecture's header for llama.cpp to open the file with vocab_only.
TINY_LLAMA = {"llama.block_count": 1, "llama.context_length": 4096, "llama.embedding_length": 64,
              "llama.feed_forward_length": 128, "llama.attention.head_count": 2,
              "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 500000.0}


def write_vocab_gguf(path: Path, arch: str, metadata: dict) -> Path:
    """A GGUF holding `metadata` (Python values; typed as llama.cpp types them) and no tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if key in ("general.architecture",) or key.startswith("GGUF."):
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif key.endswith("token_type"):
            w.add_array(key, [int(v) for v in value])  # int32, as llama.cpp writes them
        else:
            w.add_array(key, list(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gunzip(src: Path, dst: Path) -> Path:
    with gzip.open(src, "rb") as f, open(dst, "wb") as out:
        shutil.copyfileobj(f, out)
    return dst
