"""The notebooks: every .ipynb matches its jupytext .py source, and every notebook runs top to bottom on CPU with
small settings (`WEAVER_NOTEBOOK_SMALL=1`: shorter outputs, fewer training steps; a raising cell fails the test).
`make notebooks` runs them at their own settings."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("notebooks_run", Path(__file__).parents[1] / "notebooks" / "run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


@pytest.mark.parametrize("name", run.NOTEBOOKS)
def test_notebook_matches_its_source(name):
    run.check_in_sync(name)


@pytest.mark.parametrize("name", ["quickstart", "convert", "benchmark", "train"])
def test_notebook_runs(name, monkeypatch):
    monkeypatch.setenv("WEAVER_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    run.execute(name, small=True, timeout=600)
