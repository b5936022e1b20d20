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
# # Training a drafter and a Weaver adapter
#
# **Needs:** a CPU runtime, about 4 minutes (2 cores), for the small run below (a slice of data, a few
# dozen steps: it shows the pipeline and τ moving, not a useful drafter; the test suite runs every cell
# with fewer prompts, tokens and steps still, `WEAVER_NOTEBOOK_SMALL=1`). `FULL = True` runs the
# recipe the shipped SmolLM2 weights came from (needs a GPU; ~10 minutes on an H200; downloads
# the prompt sets' distributions with pip).
#
# Self-distillation: the target answers prompts, the drafter learns to predict blocks of those
# answers from the target's hidden states, then the adapter learns to re-rank the drafter's
# candidates along each path, with the drafter frozen.

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
import os  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from flax import nnx  # noqa: E402

import weaver_jax  # noqa: E402
from weaver_jax import training  # noqa: E402
from weaver_jax.convert import checkpoint  # noqa: E402

FULL = False
SMALL = os.environ.get("WEAVER_NOTEBOOK_SMALL") == "1"  # CI: every cell, with less of everything
work = Path(tempfile.mkdtemp(prefix="weaver_train_"))


def loaded(**parts):
    """SmolLM2 in float32 (with `parts`: a drafter and an adapter); in CI (SMALL) only its first 3 of 30 layers:
    every cell runs, compiled sooner, and the figures mean nothing."""
    bundle = weaver_jax.load("smollm2-135m-instruct", dtype="float32", **parts)
    if SMALL:
        bundle.target.layers = nnx.List(list(bundle.target.layers)[:3])
        bundle.target.config = bundle.target.config.replace(num_layers=3)
    return bundle


bundle = loaded()
target = bundle.target
print(jax.devices(), work)

# %% [markdown]
# ## Data: the target's own answers

# %%
if FULL:
    packages = work / "packages"
    subprocess.check_call([sys.executable, "-m", "weaver_jax.cli", "train-prompts", str(work / "prompts"),
                           "--packages", str(packages)])
    prompts = training.training_prompts(packages, code_prompts=4000, samples_per_request=8)
    options = dict(batch=512, max_prompt_tokens=256, max_new_tokens=256, sampled_copies=1)
else:
    chat = ["Explain how a rainbow forms.", "Write a haiku about autumn.", "What is a prime number?",
            "Give two tips for a job interview.", "How do plants make food?", "Summarize the plot of Cinderella.",
            "What causes earthquakes?", "Describe a healthy breakfast."]
    kept = 4 if SMALL else 8
    prompts = {"chat": chat[:kept], "code": training.stdlib_code_prompts(kept, seed=3)}
    options = dict(batch=2 * kept, max_prompt_tokens=160, max_new_tokens=24 if SMALL else 64, sampled_copies=0)
data = training.load_dataset(training.generate_dataset(bundle, prompts, work / "data", **options))
answer_tokens = int((data["lengths"] - data["prompt_lengths"]).sum())
print(data["tokens"].shape, "sequences x slots;", answer_tokens, "answer tokens")

# %% [markdown]
# ## τ before training
# A fresh (random) drafter: τ of the chain is ~1, only the target's bonus token is emitted.

# %%
from weaver_jax._adapter import Adapter, AdapterConfig  # noqa: E402
from weaver_jax._drafter import Drafter, DrafterConfig  # noqa: E402

c = target.config
drafter_config = DrafterConfig.like(c, num_layers=2 if FULL else 1, num_features=3, mask_token_id=16)
drafter = Drafter(drafter_config, rngs=nnx.Rngs(0))
held_out = bundle.tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a rainbow forms."}])


def tau(drafter, adapter=None, method="dflash", **options):
    trial = weaver_jax.Bundle(target, bundle.tokenizer, drafter, adapter, bundle.eos_token_ids)
    return weaver_jax.generate(trial, [held_out], method=method, max_new_tokens=16 if SMALL else 48, **options).stats[
        "mean_accepted_length"]


print("chain tau, untrained drafter:", tau(drafter))

# %% [markdown]
# ## The drafter
# Anchors inside each answer open blocks `[x_a, MASK...]`; the loss is cross-entropy on the block
# positions, decayed with depth. Checkpoints go to the run directory with orbax; running the cell
# again resumes from the last one.

# %%
steps = 4 if SMALL else 40
config = (training.TrainConfig(steps=4000, batch_size=32, anchors=32) if FULL else
          training.TrainConfig(steps=steps, batch_size=4, anchors=8, learning_rate=2e-3, save_every=steps // 2,
                               log_every=min(2, steps // 2)))
drafter, info = training.fit(drafter, training.drafter_loss_fn(config), data, config, work / "runs" / "drafter",
                             frozen=(target,))
print(info)
log = training.read_log(work / "runs" / "drafter")
plt.figure(figsize=(5, 3))
plt.plot([r["step"] for r in log], [r["loss"] for r in log])
plt.xlabel("step")
plt.ylabel("drafter loss")
plt.show()
print("chain tau, trained drafter:", tau(drafter))

# %% [markdown]
# ## The adapter (drafter frozen)

# %%
adapter_config = AdapterConfig.like(c, d_rank=192 if FULL else 64, num_layers=2 if FULL else 1,
                                    num_heads=3 if FULL else 1, mlp_dim=512 if FULL else 128, K=15,
                                    candidate_pool_size=512 if FULL else 64)
adapter = Adapter(adapter_config, rngs=nnx.Rngs(1))
budget = 16
print("weaver tau, untrained adapter:", tau(drafter, adapter, "weaver", budget=budget))
adapter, info = training.fit(adapter, training.adapter_loss_fn(config, adapter_config.candidate_pool_size), data,
                             config, work / "runs" / "adapter", frozen=(target, drafter))
log = training.read_log(work / "runs" / "adapter")
plt.figure(figsize=(5, 3))
plt.plot([r["step"] for r in log], [r["acc"] for r in log], label="adapter")
plt.plot([r["step"] for r in log], [r["acc_drafter"] for r in log], label="drafter's own ranking")
plt.xlabel("step")
plt.ylabel("top-1 in the pool")
plt.legend()
plt.show()
print("weaver tau, trained adapter:", tau(drafter, adapter, "weaver", budget=budget))

# %% [markdown]
# ## Save, reload, generate
# The project's checkpoint format (config.json + orbax parameters); `load` checks that target,
# drafter and adapter belong together.

# %%
checkpoint.save(work / "drafter", drafter)
checkpoint.save(work / "adapter", adapter)
reloaded = loaded(drafter=work / "drafter", adapter=work / "adapter")
plain = weaver_jax.generate(reloaded, [held_out], max_new_tokens=16 if SMALL else 32)
fast = weaver_jax.generate(reloaded, [held_out], method="weaver", max_new_tokens=16 if SMALL else 32, budget=budget)
assert fast.tokens == plain.tokens
print(bundle.tokenizer.decode(fast.tokens[0], skip_special_tokens=True))
