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
# # Benchmarks, plotted
#
# **Needs:** a CPU runtime, seconds. Reads the raw numbers behind `BENCHMARKS.md`
# (`bench/results/*.json`, one file per run) from a checkout of the repository.

# %%
# Colab or a fresh Jupyter: clone the repository for its bench/results (the package does not ship them).
import json
import os
import subprocess
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

root = next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "BENCHMARKS.md").exists()), None)
if root is None:  # outside a checkout: clone the copy WEAVER_JAX_REPOSITORY names (no public address is assumed)
    if not os.environ.get("WEAVER_JAX_REPOSITORY"):
        raise RuntimeError("run this notebook inside a checkout of weaver_jax, or set WEAVER_JAX_REPOSITORY to a "
                           "git URL of your copy")
    subprocess.check_call(["git", "clone", "-q", "--depth", "1", os.environ["WEAVER_JAX_REPOSITORY"],
                           "weaver_jax_repo"])
    root = Path("weaver_jax_repo")
results = root / "bench" / "results"
print(sorted(p.name for p in results.glob("*.json")))

# %% [markdown]
# ## τ against budget, per method and prompt set (SmolLM2-135M-Instruct, held-out prompts)

# %%
# the files of `bench/tau.py` (older ones have no temperature: they are greedy); other *_tau_* files are skipped
rows = [{"temperature": 0.0, **r} for path in sorted(results.glob("*_tau_*.json"))
        for r in json.loads(path.read_text()) if isinstance(r, dict) and {"set", "method", "tau"} <= r.keys()]
sets = ["mt_bench", "humaneval", "alpaca_heldout", "all"]
for temperature in sorted({r["temperature"] for r in rows}):
    fig, axes = plt.subplots(1, len(sets), figsize=(4 * len(sets), 3.2), sharey=False)
    for ax, name in zip(axes, sets, strict=True):
        pick = [r for r in rows if r["set"] == name and r["temperature"] == temperature]
        for method, color in (("ddtree", "tab:blue"), ("weaver", "tab:red")):
            pts = sorted((r["budget"], r["tau"]) for r in pick if r["method"] == method)
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", color=color, label=method)
        chain = [r["tau"] for r in pick if r["method"] == "dflash"]
        if chain:
            ax.axhline(chain[0], color="k", ls="--", label="dflash (chain)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name}, T={temperature:g}")
        ax.set_xlabel("budget")
        ax.set_ylabel("tau")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## Where a round's time goes (Qwen3-8B shape, H200, random weights)

# %%
verify = [r for path in sorted(results.glob("*_verify.json")) for r in json.loads(path.read_text())]
rounds = [r for r in verify if r["stage"] == "round"]
stages = ["drafter_ms", "tree_ms", "verify_ms", "accept_commit_ms"]
fig, ax = plt.subplots(figsize=(7, 3.5))
bottom = np.zeros(len(rounds))
for stage in stages:
    values = np.array([r[stage] for r in rounds])
    ax.bar([f"{r['method']}\n{r['nodes']} nodes" for r in rounds], values, bottom=bottom, label=stage[:-3])
    bottom += values
if rounds:
    ax.axhline(rounds[0]["decode_step_ms"], color="k", ls="--", label="one decode step")
ax.set_ylabel("ms per round")
ax.legend(fontsize=8)
plt.show()

# %%
nodes = [r for r in verify if r["stage"] == "verify"]
plt.figure(figsize=(5, 3))
plt.plot([r["nodes"] for r in nodes], [r["ratio"] for r in nodes], "o-")
plt.xscale("log", base=2)
plt.xlabel("tree nodes verified")
plt.ylabel("time / decode step")
plt.grid(alpha=0.3)
plt.show()
