"""GPU-only checks (`make test-gpu`, marked `gpu`): in bfloat16 on the GPU, every greedy difference
between a speculative method and `ar` in the default mode is a rounding near-tie
(`weaver_jax.testing.rounding_explanation`), and exact mode leaves none, greedy or seeded sampling.
The kernels' own tests, the float32 greedy-equality and sampling tests run on the GPU beside these."""

import jax
import numpy as np
import pytest

import weaver_jax
from weaver_jax.testing import float32_copy, random_bundle, rounding_explanation

pytestmark = pytest.mark.gpu

METHODS = [("dflash", {}), ("ddtree", {"budget": 32}), ("weaver", {"budget": 24})]


@pytest.fixture(scope="module")
def setup():
    if jax.default_backend() != "gpu":
        pytest.fail("test_gpu.py runs on a GPU (make test-gpu)")
    bundle = random_bundle(0, dtype="bfloat16", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4,
                           num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (9, 40, 17, 3, 64, 25, 12, 50)]
    return bundle, prompts


@pytest.mark.parametrize("method,options", METHODS)
def test_bf16_differences_are_rounding_near_ties(setup, method, options):
    bundle, prompts = setup
    ar = weaver_jax.generate(bundle, prompts, max_new_tokens=64, eos_token_id=[]).tokens
    spec = weaver_jax.generate(bundle, prompts, method=method, max_new_tokens=64, eos_token_id=[], **options).tokens
    reference = float32_copy(bundle.target)
    report = [rounding_explanation(bundle.target, reference, p, a, s) for p, a, s in zip(prompts, ar, spec, strict=True)
              if a != s]
    print(f"{method}: {len(prompts) - len(report)} of {len(prompts)} prompts equal to ar; differences: {report}")
    assert all(r["explained"] for r in report), report


@pytest.mark.parametrize("method,options", METHODS)
def test_exact_mode_is_bitwise_autoregressive_on_the_gpu(setup, method, options):
    bundle, prompts = setup
    for sampling in ({}, dict(temperature=1.0, top_p=0.95, seed=3)):
        ar = weaver_jax.generate(bundle, prompts, max_new_tokens=64, eos_token_id=[], exact=True, **sampling).tokens
        spec = weaver_jax.generate(bundle, prompts, method=method, max_new_tokens=64, eos_token_id=[], exact=True,
                                   **sampling, **options).tokens
        assert spec == ar, sampling
