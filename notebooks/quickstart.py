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
# # weaver_jax quickstart
#
# **Needs:** a CPU runtime (about 3 minutes) or a GPU runtime (used automatically). Python >= 3.12.
#
# SmolLM2-135M-Instruct with the drafter and Weaver adapter trained for it: plain decoding and
# Weaver side by side. At temperature 0 the two texts are identical (the method is lossless); τ is
# how many tokens one verification of the target emits.

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
import jax  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import weaver_jax  # noqa: E402

SMALL = os.environ.get("WEAVER_NOTEBOOK_SMALL") == "1"  # CI runs every cell with shorter outputs
MAX_NEW_TOKENS = 32 if SMALL else 128
print("devices:", jax.devices())

# %%
bundle = weaver_jax.load("smollm2-135m-instruct")
print(bundle.config)
print("drafter:", bundle.drafter.config.num_layers, "layers, block", bundle.drafter.config.block_size)
print("adapter: width", bundle.adapter.config.d_rank, ", pool", bundle.adapter.config.candidate_pool_size)
# what ships: a block of 16 drafted from target layers 1, 14 and 27; the adapter re-ranks 15 candidates a node
assert bundle.drafter.config.block_size == 16 and bundle.drafter.config.target_layer_ids == (1, 14, 27)
assert bundle.adapter.config.K == 15 and bundle.adapter.config.d_model == bundle.config.hidden_size == 576

# %%
prompt = "Give me three tips for learning to play the guitar."
ids = bundle.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
print(len(ids), "prompt tokens")

# %% [markdown]
# ## Temperature 0: identical text

# %%
budget = 16 if jax.default_backend() == "cpu" else 24  # 24: the default, fastest on an H200; a CPU pays per node
results = {}
for method, options in (("ar", {}), ("weaver", {"budget": budget})):
    results[method] = weaver_jax.generate(bundle, [ids], method=method, max_new_tokens=MAX_NEW_TOKENS, **options)
    text = bundle.tokenizer.decode(results[method].tokens[0], skip_special_tokens=True)
    s = results[method].stats
    tau = f", tau {s['mean_accepted_length']:.2f}" if method != "ar" else ""
    print(f"--- {method}: {s['tokens_per_second']:.1f} tokens/s{tau}\n{text}\n")
assert results["ar"].tokens == results["weaver"].tokens
assert results["weaver"].stats["mean_accepted_length"] > 1.2  # the shipped drafter and adapter are trained
print("identical:", results["ar"].tokens == results["weaver"].tokens)

# %% [markdown]
# ## Temperature 1: the same draws
# Every method draws generated token t with the same random key, `fold_in(key(seed), t)`, so with one seed
# Weaver samples the very tokens plain decoding samples (in float32, as here on a CPU; in bfloat16 a
# near-tie can round differently in a tree, which `exact=True` rules out).

# %%
sampled = {}
for method, options in (("ar", {}), ("weaver", {"budget": budget})):
    sampled[method] = r = weaver_jax.generate(bundle, [ids], method=method, max_new_tokens=MAX_NEW_TOKENS,
                                              temperature=1.0, seed=1, **options)
    tau = f", tau {r.stats['mean_accepted_length']:.2f}" if method != "ar" else ""
    print(f"--- {method}{tau}\n{bundle.tokenizer.decode(r.tokens[0], skip_special_tokens=True)}\n")
print("same tokens:", sampled["ar"].tokens == sampled["weaver"].tokens)
if jax.default_backend() == "cpu":  # float32 here: no rounding tie can part them
    assert sampled["ar"].tokens == sampled["weaver"].tokens

# %% [markdown]
# ## Accepted lengths
# Tokens emitted per verification (accepted draft tokens + the target's bonus token).

# %%
hist = np.array(results["weaver"].stats["accepted_length_histogram"])
plt.figure(figsize=(6, 3))
plt.bar(np.arange(len(hist)), hist)
plt.xlabel("tokens emitted in a round")
plt.ylabel("rounds")
plt.title(f"weaver, budget {budget}: tau = {results['weaver'].stats['mean_accepted_length']:.2f}")
plt.show()

# %% [markdown]
# ## One round's proposal tree
# The adapter's tree for the first round: depth left to right, the accepted path in red.

# %%
tree = weaver_jax.proposal_tree(bundle, ids, method="weaver", budget=budget)
depth, parent = np.array(tree["depth"]), np.array(tree["parent"])
rank = np.zeros(len(depth))
for d in range(depth.max() + 1):
    nodes = np.flatnonzero(depth == d)
    rank[nodes] = np.arange(len(nodes)) - (len(nodes) - 1) / 2
accepted = set(tree["accepted"])
fig, ax = plt.subplots(figsize=(10, 5))
for i in range(1, len(depth)):
    on_path = i in accepted and parent[i] in accepted
    ax.plot([depth[parent[i]], depth[i]], [rank[parent[i]], rank[i]], color="tab:red" if on_path else "0.7",
            lw=2 if on_path else 0.8, zorder=1)
for i in range(len(depth)):
    ax.text(depth[i], rank[i], repr(bundle.tokenizer.decode([tree["tokens"][i]]))[1:-1], ha="center", va="center",
            fontsize=8, color="tab:red" if i in accepted else "black",
            bbox=dict(boxstyle="round", fc="white", ec="tab:red" if i in accepted else "0.7"))
ax.set_xlabel("depth")
ax.set_yticks([])
ax.set_title(f"{len(depth) - 1} proposed nodes; accepted {len(accepted) - 1}, then the target's bonus "
             f"{bundle.tokenizer.decode([tree['bonus']])!r}")
plt.show()
