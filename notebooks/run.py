"""Execute notebooks top to bottom; a cell that raises fails the run.

    python notebooks/run.py quickstart train [--small]        # some; --small: what `make test` runs, every cell
    python notebooks/run.py --all                             # `make notebooks`
    python notebooks/run.py --sync                            # rewrite every .ipynb from its .py

The jupytext percent-format `.py` files are the source of truth; each `.ipynb` beside it is
generated from it (no outputs) and must stay in sync, which `check_in_sync` verifies.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOKS = ("quickstart", "convert", "train", "benchmark")


def _paired(name: str):
    import jupytext

    return jupytext.read(HERE / f"{name}.py")


def sync(name: str) -> None:
    """Rewrite the .ipynb when its cells differ from the .py (cell ids are random: an unchanged
    notebook is left alone so that syncing makes no diff)."""
    import jupytext

    try:
        check_in_sync(name)
    except (AssertionError, FileNotFoundError):
        jupytext.write(_paired(name), HERE / f"{name}.ipynb", fmt="ipynb")


def check_in_sync(name: str) -> None:
    import nbformat

    def cells(notebook):
        return [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in notebook.cells]

    source, stored = cells(_paired(name)), cells(nbformat.read(HERE / f"{name}.ipynb", as_version=4))
    if source != stored:
        raise AssertionError(f"notebooks/{name}.ipynb is out of date with {name}.py: run `make notebooks-sync`")


def execute(name: str, small: bool, timeout: int = 1800) -> None:
    import nbformat
    from nbclient import NotebookClient

    check_in_sync(name)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read by the kernel, which inherits this environment
    if small:
        os.environ["WEAVER_NOTEBOOK_SMALL"] = "1"
    notebook = nbformat.read(HERE / f"{name}.ipynb", as_version=4)
    NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(HERE)}}).execute()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", choices=[*NOTEBOOKS, []])
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--small", action="store_true", help="the shorter settings CI uses")
    parser.add_argument("--sync", action="store_true")
    args = parser.parse_args()
    names = NOTEBOOKS if args.all or args.sync or not args.names else args.names
    for name in names:
        if args.sync:
            sync(name)
        else:
            print(f"executing notebooks/{name}.ipynb", flush=True)
            execute(name, args.small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
