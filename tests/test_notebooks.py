"""The notebooks: every .ipynb matches its jupytext .py source, and the quickstart, convert and benchmark
notebooks run top to bottom on CPU with small settings (a raising cell fails the test), less their cells tagged
ci-skip (the SmolLM2 conversion, which tests/test_convert.py covers; quickstart's sampled run, the same calls as
its greedy ones at another temperature). The train notebook (~40 s at its small settings on this CPU: `python
notebooks/run.py train --small`) and every cell run in `make notebooks`: the suite's 10 minutes on 2 cores leave
no room for them."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("notebooks_run", Path(__file__).parents[1] / "notebooks" / "run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


@pytest.mark.parametrize("name", run.NOTEBOOKS)
def test_notebook_matches_its_source(name):
    run.check_in_sync(name)


@pytest.mark.parametrize("name", ["quickstart", "convert", "benchmark"])
def test_notebook_runs(name, monkeypatch):
    monkeypatch.setenv("WEAVER_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    run.execute(name, small=True, timeout=600)
