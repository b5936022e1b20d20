"""What the kernels share: `pallas_call` with the tests' poisoning, power-of-two block sizes, and
picking one element of a loaded vector."""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P


def pallas_call(kernel, args, *, grid, in_specs, out_specs, out_shape, name: str, num_warps: int, num_stages: int,
                interpret: bool, poison: bool = False, aliases: dict[int, int] | None = None):
    """`pl.pallas_call(kernel, ...)(*args)` on the Triton backend with explicit launch parameters.
    poison (tests): every output not aliased to an input starts as NaN (-7 for integers), aliased in as an
    extra input, so an element no program writes cannot pass."""
    aliases = dict(aliases or {})
    if poison:
        several = isinstance(out_shape, list | tuple)
        outputs = list(out_shape) if several else [out_shape]
        specs = list(out_specs) if several else [out_specs]
        poisoned = [i for i in range(len(outputs)) if i not in aliases.values()]
        inputs = len(args)
        in_specs = [*in_specs, *(specs[i] for i in poisoned)]
        args = [*args, *(jnp.full(outputs[i].shape, jnp.nan if jnp.issubdtype(outputs[i].dtype, jnp.floating) else -7,
                                  outputs[i].dtype) for i in poisoned)]
        aliases.update({inputs + j: i for j, i in enumerate(poisoned)})
        extra = len(poisoned)

        def kernel(*refs, inner=kernel):
            inner(*refs[:inputs], *refs[inputs + extra:])

    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          input_output_aliases=aliases, interpret=interpret, name=name,
                          compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))(*args)


def pow2_at_least(n: int, low: int = 1) -> int:
    """The smallest power of two >= max(n, low) (Triton's block dimensions are powers of two)."""
    return max(low, 1 << (max(n, 1) - 1).bit_length())


def pick(vector, index, at):
    """`vector[at]` for a scalar `at` (index: `arange` of the vector's length), without a gather on a
    loaded value, which the Triton lowering rejects."""
    return jnp.sum(jnp.where(index == at, vector, 0))


def context_mesh():
    """The ("data", "model") mesh `generate` traces a sharded bundle's programs under (`jax.set_mesh`), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or tuple(mesh.axis_names) != ("data", "model") else mesh


def heads_spec(heads: int):
    """The mesh axis a kernel's heads are split over: "model" where they divide it (a target split by
    `weaver_jax.shard`), else None (a replicated module's)."""
    mesh = context_mesh()
    return "model" if mesh is not None and heads % mesh.shape["model"] == 0 else None


def per_shard(fn, args: tuple, in_specs: tuple, out_specs):
    """`fn(*args)` on each device's shard under the context mesh (`shard_map`): XLA does not partition a Pallas
    call, so each runs on its local shapes (its grid from them) instead of on gathered inputs. Specs name "data"
    and "model" (`heads_spec`); without a mesh, `fn(*args)`."""
    mesh = context_mesh()
    if mesh is None:
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def batch_heads(ndim: int, heads: int | None = None, head_axis: int = 2) -> P:
    """A `[B, ...]` array's spec: batch over "data", and with `heads` dimension `head_axis` over
    `heads_spec(heads)`."""
    spec = ["data"] + [None] * (ndim - 1)
    if heads is not None:
        spec[head_axis] = heads_spec(heads)
    return P(*spec)


def per_shard_product(product, x, w, split: str | None, transpose_w: bool = False):
    """`product(x, w)` (x `[B, ..., K]`, w `[K, N]`, or `[N, K]` with transpose_w) per device when w is split over
    the context mesh's `model` axis: "columns" (its N: each device its own outputs) or "rows" (its K, x's features
    with it: each device a partial product; the partials are gathered and added in device order, the same order
    whatever the rows, which an all-reduce's algorithm would not promise). None, or no mesh: as it is."""
    if context_mesh() is None or split is None:
        return product(x, w)
    lead = ["data"] + [None] * (x.ndim - 2)
    if split == "columns":
        w_spec = P("model", None) if transpose_w else P(None, "model")
        return per_shard(product, (x, w), (P(*lead, None), w_spec), P(*lead, "model"))

    def partial_sums(a, b):
        parts = jax.lax.all_gather(product(a, b), "model")
        return functools.reduce(operator.add, [parts[i] for i in range(parts.shape[0])])

    w_spec = P(None, "model") if transpose_w else P("model", None)
    return per_shard(partial_sums, (x, w), (P(*lead, "model"), w_spec), P(*lead, None))
