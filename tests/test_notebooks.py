"""The notebooks: every .ipynb matches its jupytext .py source, and each runs top to bottom on CPU with its
small settings (`WEAVER_NOTEBOOK_SMALL=1`: shorter outputs, fewer prompts and steps); a raising cell fails the
test, and the cells assert what they show (identical text, the same sampled tokens, the conversions' parameters
bit for bit, a trained adapter that generates losslessly)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("notebooks_run", Path(__file__).parents[1] / "notebooks" / "run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


@pytest.mark.parametrize("name", run.NOTEBOOKS)
def test_notebook_matches_its_source(name):
    run.check_in_sync(name)


@pytest.mark.parametrize("name", run.NOTEBOOKS)
def test_notebook_runs(name, monkeypatch):
    monkeypatch.setenv("WEAVER_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    run.execute(name, small=True, timeout=600)
