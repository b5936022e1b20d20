"""`weaver-convert target`: Hugging Face and GGUF sources to a checkpoint that `load` reads, and
clear failures that leave nothing behind."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import weaver_jax
from weaver_jax.convert import cli

from .test_import import FIXTURES, logits_of, write_gguf


def convert(tmp_path, src, name="out", dtype="float32"):
    dst = tmp_path / name
    assert cli.main(["target", str(src), str(dst), "--dtype", dtype]) == 0
    return dst


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_convert_hf_round_trip(tmp_path, name, capsys):
    dst = convert(tmp_path, FIXTURES / "hf" / name)
    assert "layers" in capsys.readouterr().out
    ref = np.load(FIXTURES / "hf" / name / "reference.npz")
    bundle = weaver_jax.load(dst, dtype="float32")
    np.testing.assert_allclose(logits_of(bundle.target, ref["ids"]), ref["logits"], atol=1e-4)
    direct = weaver_jax.load(FIXTURES / "hf" / name, dtype="float32")
    prompts = [[1, 2, 3], [7, 8]]
    assert (weaver_jax.generate(bundle, prompts, max_new_tokens=8).tokens
            == weaver_jax.generate(direct, prompts, max_new_tokens=8).tokens)


def test_convert_bfloat16(tmp_path):
    dst = convert(tmp_path, FIXTURES / "hf" / "qwen3", dtype="bfloat16")
    meta = json.loads((dst / "config.json").read_text())
    assert meta["kind"] == "target" and meta["config"]["dtype"] == "bfloat16"
    bundle = weaver_jax.load(dst)
    assert str(bundle.target.embed[...].dtype) == "bfloat16"


def broken_copy(tmp_path, edit_config=None, edit_tensors=None, truncate=False):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "hf" / "qwen2", src)
    if edit_config:
        config = json.loads((src / "config.json").read_text())
        edit_config(config)
        (src / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(src / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, src / "model.safetensors")
    if truncate:
        data = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    return src


def reshape_norm(t):
    t["model.norm.weight"] = np.zeros(5, np.float32)


def add_rogue(t):
    t["model.layers.0.mlp.rogue.weight"] = np.zeros(3, np.float32)


@pytest.mark.parametrize("case,match", [
    (dict(edit_config=lambda c: c.update(architectures=["GPTNeoXForCausalLM"])), "unsupported architecture"),
    (dict(edit_tensors=lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")),
     "missing tensor model.layers.1.self_attn.k_proj.weight"),
    (dict(edit_tensors=add_rogue), r"unexpected tensors: \['model.layers.0.mlp.rogue.weight'\]"),
    (dict(edit_tensors=reshape_norm), r"final_norm: expected shape \(64,\), got \(5,\)"),
    (dict(truncate=True), "truncated or not safetensors"),
])
def test_bad_sources_fail_clearly_and_leave_nothing(tmp_path, capsys, case, match):
    src = broken_copy(tmp_path, **case)
    dst = tmp_path / "out"
    assert cli.main(["target", str(src), str(dst)]) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(match, err), err
    assert not dst.exists() and not list(tmp_path.glob(".out.*"))


def test_truncated_gguf_and_existing_destination(tmp_path, capsys):
    from .conftest import make_pair

    cfg, weights, _ = make_pair("llama_tied", seed=1)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, weights, "llama")
    dst = convert(tmp_path, path, name="ok")
    assert cli.main(["target", str(path), str(dst)]) == 2
    assert "already exists" in capsys.readouterr().err
    whole = path.read_bytes()
    path.write_bytes(whole[:-1])  # the last tensor's data cut short
    assert cli.main(["target", str(path), str(tmp_path / "bad")]) == 2
    assert "not a readable GGUF file (ValueError: truncated: tensor " in capsys.readouterr().err
    path.write_bytes(whole[:300])  # inside the header
    assert cli.main(["target", str(path), str(tmp_path / "bad")]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_dflash_drafter_matches_the_pytorch_reference(tmp_path):
    """tests/fixtures/dflash was written by an independent PyTorch forward (make_fixtures.py)."""
    import jax.numpy as jnp

    dst = tmp_path / "drafter"
    assert cli.main(["drafter", str(FIXTURES / "dflash"), str(dst)]) == 0
    bundle = weaver_jax.load(FIXTURES / "hf" / "qwen3", dtype="float32", drafter=dst)
    drafter = bundle.drafter
    assert drafter.config.target_layer_ids == (0, 1) and drafter.config.block_size == 5
    ref = np.load(FIXTURES / "dflash" / "reference.npz")
    c = ref["ctx"].shape[0]
    hidden = tuple(jnp.asarray(x)[None] for x in np.split(ref["ctx"], 2, axis=-1))
    cache = drafter.commit(drafter.init_cache(1, 32), hidden, jnp.arange(c)[None], jnp.array([c]))
    np.testing.assert_allclose(np.asarray(drafter(jnp.asarray(ref["block"])[None], cache))[0], ref["states"],
                               atol=1e-4)
    # the converted bundle generates losslessly with the imported drafter
    prompts = [[1, 2, 3, 4]]
    assert (weaver_jax.generate(bundle, prompts, method="dflash", max_new_tokens=10).tokens
            == weaver_jax.generate(bundle, prompts, max_new_tokens=10).tokens)


def test_drafter_for_another_target_is_refused(tmp_path):
    dst = tmp_path / "drafter"
    assert cli.main(["drafter", str(FIXTURES / "dflash"), str(dst)]) == 0
    with pytest.raises(ValueError, match="drafter does not match the target: target width 64 != 576; vocabulary 256"):
        weaver_jax.load("smollm2-135m-instruct", drafter=dst)
    with pytest.raises(ValueError, match="holds a drafter checkpoint"):
        weaver_jax.load(dst)


def test_dflash_config_without_layer_ids_needs_the_target_depth(tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "dflash", src)
    config = json.loads((src / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (src / "config.json").write_text(json.dumps(config))
    assert cli.main(["drafter", str(src), str(tmp_path / "a")]) == 2
    assert "--target-layers" in capsys.readouterr().err
    assert cli.main(["drafter", str(src), str(tmp_path / "b"), "--target-layers", "36"]) == 0
    assert json.loads((tmp_path / "b" / "config.json").read_text())["config"]["target_layer_ids"] == [1, 33]
