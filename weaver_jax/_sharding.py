"""Bundles over several devices: SPMD sharding over a `jax.sharding.Mesh` with axes ("data", "model").

XLA partitions the jitted programs from the shardings of their inputs (NCCL links GPUs): nothing here runs
a collective by hand. Megatron-style tensor parallelism over `model`: q / k / v and gate / up split by heads /
features, o and down by their input (XLA adds one all-reduce after each), the LM head by vocabulary; embeddings
and norms replicated. The batch and every per-sequence array (KV cache, lengths, tokens) over `data`.

A fused projection (`qkv`, `gate_up`) is a concatenation of segments; split by columns it would hand a device
parts of q and k of different heads. `shard` reorders its columns into per-device groups first
(`_model.group_columns`) and tells the module (`groups`), which splits its output accordingly;
`module_params` undoes it, so a sharded module saves the same checkpoint as the unsharded one.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from weaver_jax._gdn import GatedDeltaNet
from weaver_jax._model import MLP, Attention, KVCache, group_columns, ungroup_columns

AXES = ("data", "model")

# Logical axes of a parameter's dimensions, by the end of its name (None: not split). Every other parameter
# (norms, the drafter's `fc`, the adapter's tables, ...) is replicated.
PARAMETER_AXES = {
    "embed": (None, None),  # a lookup, and the tied LM head's weight: replicated
    "lm_head": (None, "vocab"),
    "attn.qkv": (None, "heads"), "attn.qkv_bias": ("heads",), "attn.out": ("heads", None),
    "mlp.gate_up": (None, "ffn"), "mlp.gate_up_bias": ("ffn",), "mlp.down": ("ffn", None),
    # hybrid targets: gated attention (q and its gate interleaved per head), Gated DeltaNet by key / value heads
    "mixer.q_gate": (None, "heads"), "mixer.k": (None, "kv_heads"), "mixer.v": (None, "kv_heads"),
    "mixer.out": ("heads", None), "mixer.in_qkv": (None, "heads"), "mixer.conv": ("heads", None),
    "mixer.in_z": (None, "heads"), "mixer.in_b": (None, "heads"), "mixer.in_a": (None, "heads"),
    "mixer.A_log": ("heads",), "mixer.dt_bias": ("heads",),
}
# Logical axis -> mesh axis. One table for parameters, caches and activations.
MESH_AXES = {"heads": "model", "ffn": "model", "vocab": "model", "kv_heads": "model", "batch": "data"}


def check_rules(parameter_axes: dict = PARAMETER_AXES, mesh_axes: dict = MESH_AXES) -> None:
    """Refuse a table that would put two dimensions of one tensor on the same mesh axis, or name a mesh axis
    other than "data" and "model"."""
    for logical, axis in mesh_axes.items():
        if axis not in AXES:
            raise ValueError(f"logical axis {logical!r} maps to {axis!r}, not a mesh axis {AXES}")
    for name, axes in parameter_axes.items():
        used = [mesh_axes[a] for a in axes if a is not None and mesh_axes.get(a) is not None]
        if len(used) != len(set(used)):
            raise ValueError(f"{name}: two dimensions on one mesh axis ({axes} -> {used})")


def _rule(name: str) -> tuple | None:
    return next((axes for suffix, axes in PARAMETER_AXES.items() if name == suffix or name.endswith("." + suffix)),
                None)


def parameter_spec(name: str, shape: tuple[int, ...], mesh: Mesh, label: str = "") -> PartitionSpec:
    """The PartitionSpec of parameter `name` (flat, as `module_params` prints it); a dimension that its mesh
    axis does not divide is an error naming the tensor (after `label`, the module's part: "drafter")."""
    axes = _rule(name)
    if axes is None:
        return PartitionSpec()
    name = f"{label} {name}".strip()
    if len(axes) != len(shape):
        raise ValueError(f"{name}: {len(shape)} dimensions, but the sharding rule names {len(axes)}")
    spec = []
    for logical, size in zip(axes, shape, strict=True):
        axis = MESH_AXES.get(logical) if logical is not None else None
        if axis is not None and size % mesh.shape[axis]:
            raise ValueError(f"{name}: dimension {logical!r} of size {size} does not divide over the mesh's "
                             f"{axis!r} axis of {mesh.shape[axis]} devices")
        spec.append(axis)
    return PartitionSpec(*spec)


def auto_mesh(mesh: Mesh) -> Mesh:
    """`mesh` checked (axes ("data", "model")) and with both axes of type Auto: XLA propagates the shardings
    through the programs (`jax.make_mesh` makes Explicit axes, whose typed shardings these programs do not
    annotate)."""
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
        raise ValueError(f"a mesh with axes {AXES} is needed (either may have size 1), got "
                         f"{getattr(mesh, 'axis_names', mesh)!r}")
    auto = jax.sharding.AxisType.Auto
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(AXES))


def _fused_modules(module: nnx.Module):
    return [(path, m) for path, m in nnx.iter_graph(module) if isinstance(m, Attention | MLP | GatedDeltaNet)]


def group_fused(module: nnx.Module, groups: int, label: str = "") -> None:
    """Group `module`'s fused projections for `groups` devices on `model`, in place: their columns reordered into
    per-device groups (when they hold values: an abstract module, `nnx.eval_shape`'s, only takes the count) and
    each module told. label: what errors call the module ("drafter")."""
    for path, sub in _fused_modules(module):
        for name, (segments, axis) in sub.fused().items():
            param = getattr(sub, name)
            # a device holds whole heads: the KV heads must divide (the query heads follow their KV head; a
            # GDN layer's value heads follow their key head)
            units = ((sub.num_kv_heads, "KV heads") if isinstance(sub, Attention) else
                     (sub.heads[0], "key heads") if isinstance(sub, GatedDeltaNet) else (segments[0], "features"))
            if units[0] % groups:
                where = f"{label} {'.'.join(map(str, (*path, name)))}".strip()
                raise ValueError(f"{where}: {units[0]} {units[1]} do not divide over the mesh's 'model' axis of "
                                 f"{groups} devices")
            if isinstance(param.get_value(), jax.ShapeDtypeStruct):
                continue
            if sub.groups > 1:  # already grouped for another mesh
                param[...] = ungroup_columns(param[...], segments, sub.groups, axis)
            param[...] = group_columns(param[...], segments, groups, axis)
        sub.groups = groups


def parameter_shardings(state, mesh: Mesh, replicate: bool = False, label: str = ""):
    """`nnx.to_pure_dict(state)` of a module's parameters -> the same tree of their `NamedSharding`s on `mesh`
    (by `PARAMETER_AXES`; replicate: every one whole on every device)."""
    def spec(path, leaf):
        name = ".".join(str(k.key) for k in path)
        return NamedSharding(mesh, PartitionSpec() if replicate else parameter_spec(name, tuple(leaf.shape), mesh,
                                                                                    label))

    return jax.tree_util.tree_map_with_path(spec, state)


def shard_module(module: nnx.Module, mesh: Mesh, replicate: bool = False, label: str = "") -> nnx.Module:
    """A copy of `module` on `mesh`: its fused projections grouped per `model` device and every parameter placed
    by `PARAMETER_AXES` (replicate: every parameter whole on every device, fused columns as they are). label: what
    errors call the module ("drafter")."""
    mesh = auto_mesh(mesh)
    module = nnx.clone(module)
    group_fused(module, 1 if replicate else mesh.shape["model"], label)
    graphdef, state = nnx.split(module)
    values = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, jax.device_put(values, parameter_shardings(values, mesh, replicate, label)))
    return nnx.merge(graphdef, state)


def shard(bundle, mesh: Mesh, *, replicate: tuple[str, ...] = ("adapter",)):
    """`bundle` on `mesh` (axes ("data", "model")): the target and drafter split over `model` by
    `PARAMETER_AXES`, the parts named in `replicate` ("target", "drafter", "adapter") whole on every device.
    `generate` then runs every method on it unchanged, its batch split over `data` (padded inside to a multiple
    of that axis). -> a new Bundle (the given one is left as it was).

        mesh = jax.make_mesh((1, 2), ("data", "model"))
        sharded = weaver_jax.shard(bundle, mesh)              # the adapter replicated, the rest split
        weaver_jax.generate(sharded, [ids], method="weaver", max_new_tokens=64)"""
    mesh = auto_mesh(mesh)
    unknown = set(replicate) - {"target", "drafter", "adapter"}
    if unknown:
        raise ValueError(f"replicate names {sorted(unknown)}; parts are 'target', 'drafter', 'adapter'")
    parts = {name: getattr(bundle, name) for name in ("target", "drafter", "adapter")}
    placed = {name: None if m is None else shard_module(m, mesh, replicate=name in replicate, label=name)
              for name, m in parts.items()}
    return dataclasses.replace(bundle, **placed, mesh=mesh)


def cache_specs(cache: KVCache, model: int) -> KVCache:
    """PartitionSpecs for a cache on a mesh whose `model` axis has `model` devices: everything over `data` by its
    batch (first) dimension; the K/V `[B, S, H_kv, D]` also over `model` by KV heads, and a hybrid target's GDN
    states (`[B, H_v, d_k, d_v]`, conv `[B, C, W - 1]`) by heads / channels, where they divide (a replicated
    module's cache keeps them whole). The caches' placement and the kernels that take a cache share it."""

    def split(leaf, dim):  # batch over data, `dim` over model when it divides
        spec = [MESH_AXES["batch"]] + [None] * (leaf.ndim - 1)
        if leaf.shape[dim] % model == 0:
            spec[dim] = MESH_AXES["heads"]
        return PartitionSpec(*spec)

    specs = jax.tree.map(lambda leaf: PartitionSpec(MESH_AXES["batch"], *([None] * (leaf.ndim - 1))), cache)
    specs = dataclasses.replace(specs, k=tuple(split(k, 2) for k in cache.k), v=tuple(split(v, 2) for v in cache.v))
    if hasattr(cache, "states"):
        specs = dataclasses.replace(specs, states=jax.tree.map(lambda leaf: split(leaf, 1), cache.states))
    return specs


def cache_sharding(mesh: Mesh, cache: KVCache) -> KVCache:
    """`cache_specs` as shardings on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), cache_specs(cache, mesh.shape["model"]),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Per-sequence arrays `[B, ...]`: batch over `data`."""
    return NamedSharding(mesh, PartitionSpec(MESH_AXES["batch"], *([None] * (ndim - 1))))


check_rules()
