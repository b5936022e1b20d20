import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # Most of the suite's time is XLA compiling: on the CPU, LLVM at optimisation level 0 compiles a third
    # faster (the greedy tests), while runtime-bound tests (16000-sample distributions) run ~a third slower;
    # the suite as a whole gains (2-worker suite: ~920 s with it, 1237 s without). Set before jax starts;
    # subprocesses (CLI, notebook kernels) inherit it. WEAVER_JAX_TEST_XLA_FLAGS="" turns it off.
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), os.environ.get(
        "WEAVER_JAX_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")]).strip()

import gc  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

import weaver_jax  # noqa: E402
from weaver_jax.convert.hf import target_params_from_hf  # noqa: E402
from weaver_jax.testing import random_config  # noqa: E402

from . import reference  # noqa: E402

# float32 products at full precision (a GPU's default may round them through TF32); `make test-gpu` also
# reports the greedy tests at JAX's default (WEAVER_JAX_TEST_PRECISION=default)
jax.config.update("jax_default_matmul_precision", os.environ.get("WEAVER_JAX_TEST_PRECISION", "highest"))

FAMILIES = {
    "llama3": dict(family="llama", llama3_scaling=True),
    "llama_tied": dict(family="llama", tie_embeddings=True),
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3", head_dim=32),
}


def make_pair(name: str, seed: int = 0, dtype: str = "float32", **overrides):
    """A random config, its HF-named weights, and the Flax target built from them by the key map."""
    cfg = random_config(**{**FAMILIES[name], **overrides, "dtype": dtype})
    weights = reference.random_hf_weights(cfg, seed)
    target = weaver_jax.target_from_params(cfg, target_params_from_hf(cfg, weights))
    return cfg, weights, target


def pytest_collection_modifyitems(items):
    """The longest tests first (the 8-device subprocess ~2 minutes, each notebook ~0.5-1): `pytest -n 2` hands
    out the rest as workers free up, so neither worker is left alone with one at the end."""
    items.sort(key=lambda item: not item.nodeid.startswith(("tests/test_sharding.py::",
                                                            "tests/test_notebooks.py::test_notebook_runs")))


@pytest.fixture(autouse=True)
def _auto_costs(tmp_path_factory, monkeypatch):
    """method="auto"'s round times and acceptance in a file of this test session (one per worker), not the
    user's cache (a test that needs a file of its own patches `cost_file` again)."""
    from weaver_jax import _auto

    path = tmp_path_factory.getbasetemp() / "auto_costs.json"
    monkeypatch.setattr(_auto, "cost_file", lambda: path)


def _memory_maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


_MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")
MAP_LIMIT = int(_MAX_MAP_COUNT.read_text()) if _MAX_MAP_COUNT.exists() else 0
_last_map_check = [0.0]


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Each program XLA compiles for the CPU keeps its code in memory maps of its own (a `generate` program a few
    hundred), and a worker compiles thousands: past Linux's vm.max_map_count (65530 by default) the next map fails
    and the worker dies inside XLA's compile, segfault or abort (once in nearly every full run, ~80% through:
    reproduced in 3 minutes with the limit at 15000). Past half the limit, every compiled program is let go
    (`generate`'s and jax's caches), which unmaps them; a later test compiles what it needs again. Counted at
    most every 10 s (reading the maps takes ~40 ms at 30000)."""
    yield
    if MAP_LIMIT and time.monotonic() - _last_map_check[0] > 10:
        _last_map_check[0] = time.monotonic()
        if _memory_maps() > MAP_LIMIT // 2:
            from weaver_jax import _generate

            _generate._COMPILED.clear()
            jax.clear_caches()
            gc.collect()


@pytest.fixture
def programs(monkeypatch):
    """The distinct compiled programs `generate` (and streams) ran during the test, by id: compiled here or taken
    from its cache (programs of earlier tests are reused, not compiled again)."""
    from weaver_jax import _generate

    used, compiled = {}, _generate._compiled

    def spy(fn, static, *args):
        program = compiled(fn, static, *args)
        used[id(program)] = program
        return program

    monkeypatch.setattr(_generate, "_compiled", spy)
    return used


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param
