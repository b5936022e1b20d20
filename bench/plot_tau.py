"""τ against budget per method and prompt set, from bench/tau.py's JSON (one or more files).

    python bench/plot_tau.py bench/results/2026-11-30_smollm2_tau_h200.json --out tau.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"dflash": ("k", "--"), "ddtree": ("tab:blue", "-"), "weaver": ("tab:red", "-")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("json", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [r for path in args.json for r in json.loads(path.read_text())]
    temps = sorted({r["temperature"] for r in rows})
    sets = [s for s in ("mt_bench", "humaneval", "alpaca_heldout", "all") if any(r["set"] == s for r in rows)]
    budgets = sorted({r["budget"] for r in rows if r["budget"]})
    fig, axes = plt.subplots(len(temps), len(sets), figsize=(4 * len(sets), 3.2 * len(temps)), squeeze=False)
    for i, temp in enumerate(temps):
        for j, name in enumerate(sets):
            ax = axes[i][j]
            for method, (color, line) in STYLE.items():
                pts = sorted((r["budget"] or 0, r["tau"]) for r in rows
                             if r["set"] == name and r["temperature"] == temp and r["method"] == method)
                if method == "dflash" and pts:
                    ax.axhline(pts[0][1], color=color, ls=line, label="dflash (chain)")
                elif pts:
                    ax.plot(*zip(*pts, strict=True), color=color, ls=line, marker="o", label=method)
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_title(f"{name}, T={temp:g}")
            ax.set_xlabel("budget (tree nodes)")
            ax.set_ylabel("tau (tokens / verification)")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)


if __name__ == "__main__":
    main()
