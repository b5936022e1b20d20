"""PyTorch pickles without torch: `pytorch_model.bin` targets and published Weaver adapters match
their references; hostile or damaged pickles are refused by name; a bundle that does not belong
together is refused at load time."""

import collections
import io
import pickle
import re
import shutil
import sys
import types
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import weaver_jax
from weaver_jax import testing
from weaver_jax.convert import cli, torch_pickle

from .test_import import FIXTURES, logits_of

WEAVER = FIXTURES / "weaver"


def test_torch_is_not_installed_here():
    """These tests exercise the torch-free reader (CI has no torch)."""
    with pytest.raises(ImportError):
        import torch  # noqa: F401


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_pytorch_bin_targets_match_transformers(tmp_path, name):
    src = FIXTURES / "hf" / f"{name}_bin"
    assert (src / "pytorch_model.bin").exists() and not (src / "model.safetensors").exists()
    ref = np.load(src / "reference.npz")
    direct = weaver_jax.load(src, dtype="float32")
    np.testing.assert_allclose(logits_of(direct.target, ref["ids"]), ref["logits"], atol=1e-4)
    dst = tmp_path / "out"
    assert cli.main(["target", str(src), str(dst)]) == 0
    converted = weaver_jax.load(dst)
    prompts = [[1, 2, 3], [9, 8, 7, 6]]
    assert (weaver_jax.generate(converted, prompts, max_new_tokens=6).tokens
            == weaver_jax.generate(direct, prompts, max_new_tokens=6).tokens)


def _reference_target(ref):
    """A target whose embedding and LM head are the reference's E and W (the adapter reads only those)."""
    config = testing.random_config(vocab_size=ref["embed"].shape[0], hidden_size=ref["embed"].shape[1],
                                   num_layers=1)
    target = testing.random_target(config)
    target.embed[...] = jnp.asarray(ref["embed"])
    target.lm_head[...] = jnp.asarray(ref["head"].T)
    return target


def test_published_adapter_matches_the_pytorch_reference(tmp_path, capsys):
    ref = np.load(WEAVER / "reference.npz")
    dst = tmp_path / "adapter"
    assert cli.main(["adapter", str(WEAVER / "adapter.pt"), str(dst)]) == 0
    assert "Weaver adapter, 2 layers, width 32, K 4, pool 16" in capsys.readouterr().out
    target = _reference_target(ref)
    for adapter in (weaver_jax.convert.checkpoint.load(dst)[0],
                    weaver_jax.convert.weaver.load_published_adapter(WEAVER / "adapter.pt")):
        tables = adapter.tables(target)
        states = adapter.teacher_forced(tables, jnp.asarray(ref["root"]), jnp.asarray(ref["drafted"]),
                                        jnp.asarray(ref["path"]))
        np.testing.assert_allclose(states, ref["states"], atol=2e-5)
        scores = ref["pool_logits"] + jnp.einsum("bkpr,bkr->bkp", jnp.take(tables.candidate, ref["pool"], axis=0),
                                                 states)
        np.testing.assert_allclose(scores, ref["scores"], atol=2e-4)


def test_bundle_with_a_published_adapter_generates_losslessly(tmp_path):
    """load(target, drafter=..., adapter=<published .pt>) converts on the fly; Weaver == plain decoding."""
    ref = np.load(WEAVER / "reference.npz")
    target = _reference_target(ref)
    from weaver_jax._drafter import Drafter, random_drafter_config
    from weaver_jax.convert import checkpoint

    drafter = Drafter(random_drafter_config(target.config, block_size=5), rngs=nnx.Rngs(0))
    target_dir, drafter_dir = checkpoint.save(tmp_path / "t", target), checkpoint.save(tmp_path / "d", drafter)
    bundle = weaver_jax.load(target_dir, drafter=drafter_dir, adapter=WEAVER / "adapter.pt")
    prompts = [[5, 6, 7], [1, 2]]
    plain = weaver_jax.generate(bundle, prompts, max_new_tokens=10, eos_token_id=[])
    assert weaver_jax.generate(bundle, prompts, method="weaver", max_new_tokens=10, eos_token_id=[],
                               budget=12).tokens == plain.tokens


def test_mismatched_bundles_are_refused(tmp_path):
    ref = np.load(WEAVER / "reference.npz")
    target = _reference_target(ref)
    from weaver_jax._drafter import Drafter, random_drafter_config
    from weaver_jax.convert import checkpoint

    shallow = Drafter(random_drafter_config(target.config, block_size=4), rngs=nnx.Rngs(0))  # depth 3 < K = 4
    target_dir, drafter_dir = checkpoint.save(tmp_path / "t", target), checkpoint.save(tmp_path / "d", shallow)
    with pytest.raises(ValueError, match="depth K=4, but the drafter proposes only 3"):
        weaver_jax.load(target_dir, drafter=drafter_dir, adapter=WEAVER / "adapter.pt")
    narrow = testing.random_target(testing.random_config(vocab_size=256, hidden_size=48))
    narrow = checkpoint.save(tmp_path / "n", narrow)
    with pytest.raises(ValueError, match="adapter does not match the target"):
        weaver_jax.load(narrow, adapter=WEAVER / "adapter.pt")


def _pickle_zip(path, payload: bytes, storages=None):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", payload)
        for key, data in (storages or {}).items():
            z.writestr(f"archive/data/{key}", data)


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_hostile_pickle_is_refused_by_name(tmp_path, capsys):
    src = tmp_path / "model"
    shutil.copytree(FIXTURES / "hf" / "qwen2_bin", src)
    _pickle_zip(src / "pytorch_model.bin", pickle.dumps({"w": _Evil()}))
    with pytest.raises(torch_pickle.RefusedPickle, match=r"global (posix|os)\.system"):
        torch_pickle.load(src / "pytorch_model.bin")
    assert cli.main(["target", str(src), str(tmp_path / "dst")]) == 2
    assert "weights-only load refuses" in capsys.readouterr().err and not (tmp_path / "dst").exists()
    evil = tmp_path / "adapter.pt"
    _pickle_zip(evil, pickle.dumps({"config": {}, "state_dict": _Evil()}))
    assert cli.main(["adapter", str(evil), str(tmp_path / "a")]) == 2
    assert "system" in capsys.readouterr().err and not (tmp_path / "a").exists()


def test_damaged_pickles_fail_clearly(tmp_path, capsys):
    src = tmp_path / "model"
    shutil.copytree(FIXTURES / "hf" / "llama3_bin", src)
    data = (src / "pytorch_model.bin").read_bytes()
    (src / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    assert cli.main(["target", str(src), str(tmp_path / "dst")]) == 2
    assert "not a zip archive" in capsys.readouterr().err and not (tmp_path / "dst").exists()
    not_zip = tmp_path / "legacy.pt"
    not_zip.write_bytes(b"\x80\x02legacy torch format")
    with pytest.raises(ValueError, match="legacy pre-1.6 torch format"):
        torch_pickle.load(not_zip)


def _write_torch_file(path, obj, monkeypatch):
    """`torch.save`'s zip layout for nested dicts of float32 arrays, written without torch: fake
    `torch` / `torch._utils` modules exist only while pickling, so the globals are named as torch
    names them."""
    torch_module, utils = types.ModuleType("torch"), types.ModuleType("torch._utils")

    class FloatStorage:
        pass

    def _rebuild_tensor_v2(*args):
        raise AssertionError("never called")

    FloatStorage.__module__, FloatStorage.__qualname__ = "torch", "FloatStorage"
    _rebuild_tensor_v2.__module__, _rebuild_tensor_v2.__qualname__ = "torch._utils", "_rebuild_tensor_v2"
    torch_module.FloatStorage, torch_module._utils, utils._rebuild_tensor_v2 = FloatStorage, utils, _rebuild_tensor_v2
    storages = {}

    class Storage:
        def __init__(self, data):
            self.data = data

    class Tensor:
        def __init__(self, array):
            self.a = np.ascontiguousarray(array, np.float32)

        def __reduce__(self):
            strides = tuple(s // 4 for s in self.a.strides)
            return _rebuild_tensor_v2, (Storage(self.a.ravel()), 0, self.a.shape, strides, False,
                                        collections.OrderedDict())

    class Saver(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, Storage):
                key = str(len(storages))
                storages[key] = o.data.tobytes()
                return ("storage", FloatStorage, key, "cpu", o.data.size)
            return None

    def wrap(x):
        return {k: wrap(v) for k, v in x.items()} if isinstance(x, dict) else (
            Tensor(x) if isinstance(x, np.ndarray) else x)

    buf = io.BytesIO()
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torch", torch_module)
        m.setitem(sys.modules, "torch._utils", utils)
        Saver(buf, protocol=2).dump(wrap(obj))
    _pickle_zip(path, buf.getvalue(), storages)
    return path


def _edited_adapter(tmp_path, monkeypatch, edit):
    payload = torch_pickle.load(WEAVER / "adapter.pt")
    edit(payload)
    return _write_torch_file(tmp_path / "edited.pt", {"config": payload["config"], "state_dict": payload["state_dict"]},
                             monkeypatch)


@pytest.mark.parametrize("edit, match", [
    (lambda p: p["state_dict"].pop("blocks.1.o_proj.weight"), "missing tensor blocks.1.o_proj.weight"),
    (lambda p: p["state_dict"].update(extra=np.zeros(3)), r"unexpected tensors: \['extra'\]"),
    (lambda p: p["state_dict"].update({"token_in.weight": np.zeros((8, 64))}), "token_in: expected shape"),
    (lambda p: p["config"].update(activation="gelu"), "unsupported Weaver variant: activation='gelu'"),
    (lambda p: p["config"].pop("K"), r"Weaver config lacks \['K'\]"),
])
def test_bad_adapters_fail_by_name(tmp_path, monkeypatch, capsys, edit, match):
    src = _edited_adapter(tmp_path, monkeypatch, edit)
    assert cli.main(["adapter", str(src), str(tmp_path / "dst")]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "dst").exists()


def test_unedited_rewrite_converts(tmp_path, monkeypatch):
    """The test's own writer produces what the reader accepts (so the failures above are the edits')."""
    src = _edited_adapter(tmp_path, monkeypatch, lambda p: None)
    assert cli.main(["adapter", str(src), str(tmp_path / "dst")]) == 0
