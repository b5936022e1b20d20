"""The Weaver search in its Pallas kernels (interpret mode on a CPU, compiled on a GPU) builds the tree the XLA search
builds, takes the adapters it is meant for, and lowers for CUDA (Triton) at the library's shapes.

The tree comparisons use fixed seeds: both searches pick top-k's of float32 scores computed in
different orders, so fresh draws would now and then meet a near tie (two scores within ~1e-6) and
differ legitimately; greedy generation with these kernels equals plain decoding on fresh inputs in
test_pallas_tree_attention.py and test_speculative.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import weaver_jax as wj
from weaver_jax._adapter import Adapter, AdapterConfig, Tables, weaver_tree
from weaver_jax._model import KVCache
from weaver_jax.pallas_kernels import kernel_scope
from weaver_jax.pallas_kernels import weaver_search as ws

from .conftest import make_pair
from .cuda import lower_for_cuda
from .test_tree import check_valid_tree

CASES = [  # seed, batch, depth, budget, children, root children, expansions, d_rank, heads, mlp, pool
    (0, 2, 5, 24, 4, 11, 3, 64, 2, 96, 64),  # MLP columns past the last whole block, a wider root (padded)
    (1, 1, 3, 7, 8, 8, 1, 96, 3, 64, 128),  # width not a power of two, one node per call
    (2, 3, 7, 64, 3, 3, 16, 32, 1, 64, 32),  # more nodes per call than children per node, odd children
]


@pytest.mark.parametrize("case", CASES)
def test_kernels_build_the_xla_tree(case):
    seed, b, depth, budget, children, root_children, expansions, d_rank, heads, mlp, pool = case
    cfg, _, target = make_pair("qwen3", seed=seed, vocab_size=128)
    config = AdapterConfig.like(cfg, d_rank=d_rank, num_layers=2, num_heads=heads, mlp_dim=mlp, K=depth,
                                candidate_pool_size=pool)
    assert ws.fits(config)
    adapter = Adapter(config, rngs=nnx.Rngs(seed))
    keys = jax.random.split(jax.random.key(seed), 3)
    inputs = dict(root=jnp.arange(b) + 3, root_state=jax.random.normal(keys[0], (b, cfg.hidden_size)),
                  drafter_states=jax.random.normal(keys[1], (b, depth, cfg.hidden_size)),
                  marginal_logits=2 * jax.random.normal(keys[2], (b, depth, 128)))
    options = dict(budget=budget, children=children, root_children=root_children, expansions=expansions,
                   pool_size=pool)
    tables = adapter.tables(target)
    with kernel_scope(()):  # jitted like the kernels' search: one compile instead of one per eager op
        want = jax.jit(lambda x: weaver_tree(adapter, tables, **x, **options))(inputs)
    with kernel_scope(("weaver_search",)):
        got = jax.jit(lambda x: weaver_tree(adapter, tables, **x, **options))(inputs)
    check_valid_tree(got, depth)
    for a, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, w)


def test_which_adapters_take_the_kernels():
    target = wj.smollm2_135m()
    shipped = AdapterConfig.like(target, d_rank=192, num_layers=2, num_heads=3, mlp_dim=512, K=15)
    assert ws.fits(shipped)
    assert not ws.fits(AdapterConfig.like(target, d_rank=64, num_layers=2, num_heads=4, mlp_dim=128, K=15))  # head 16
    assert not ws.fits(AdapterConfig.like(target, d_rank=1024, num_layers=2, num_heads=8, mlp_dim=4096, K=15))
    adapter = nnx.eval_shape(lambda: Adapter(shipped, rngs=nnx.Rngs(0)))
    small = KVCache.init(shipped.block_config, 1, 40)
    with pytest.raises(ValueError, match=r"the adapter cache needs \d+ slots, got 40"):
        ws.weaver_search(adapter, None, small, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 15, 512), jnp.int32),
                         jnp.zeros((1, 15, 512)), budget=64, children=8, expansions=4, max_depth=15,
                         prefix_len=16)


LIBRARY_SHAPES = [  # batch, budget, expansions, root children, d_rank, heads, mlp, pool, dtype: the shipped
    # SmolLM2 adapter at generate's defaults (budget 24, 8 per call, pool 64), B 1 / 8, budget 64 / 256 (a root of 32
    # children), its full pool; the widest adapter that fits
    (1, 64, 4, 8, 192, 3, 512, 512, jnp.bfloat16), (8, 64, 8, 32, 192, 3, 512, 512, jnp.bfloat16),
    (1, 24, 8, 8, 192, 3, 512, 64, jnp.bfloat16), (1, 256, 16, 8, 192, 3, 512, 512, jnp.bfloat16),
    (1, 64, 4, 8, 512, 4, 1024, 512, jnp.float32),
]


@pytest.mark.parametrize("shape", LIBRARY_SHAPES)
def test_lowers_for_cuda(shape):
    b, budget, w, root, d, heads, mlp, pool, dtype = shape
    config = AdapterConfig.like(wj.smollm2_135m(), d_rank=d, num_layers=2, num_heads=heads, mlp_dim=mlp, K=15,
                                candidate_pool_size=pool, dtype=jnp.dtype(dtype).name)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Adapter(config, rngs=nnx.Rngs(0))))
    cache = jax.eval_shape(lambda: KVCache.init(config.block_config, b, ws.cache_size(16, budget, w)))
    table = jax.ShapeDtypeStruct((49152, d), dtype)
    pool_ids, pool_logits = jax.ShapeDtypeStruct((b, 15, pool), jnp.int32), jax.ShapeDtypeStruct((b, 15, pool),
                                                                                               jnp.float32)
    search = jax.jit(lambda p, *args: ws.weaver_search(nnx.merge(graphdef, p), *args, budget=budget, children=8,
                                                       expansions=w, max_depth=15, prefix_len=16,
                                                       root_children=root))
    text = lower_for_cuda(search, params, Tables(table, table), cache, jax.ShapeDtypeStruct((b,), jnp.int32),
                          pool_ids, pool_logits)
    assert "weaver_expand" in text and "weaver_children" in text
