"""Lowering Pallas Triton kernels for CUDA on a CPU-only machine, with the Triton IR verified.

`.lower(lowering_platforms=("cuda",))` builds each kernel's Triton module but only serialises it;
the GPU's compiler verifies it later. So the modules are also verified here: an op the Triton
dialect rejects (seen: an `scf.for` whose trip count lowered to i1) fails CI, not the GPU run."""

from unittest import mock

import jax
from jax._src.pallas.triton import lowering
from jax.sharding import AbstractDevice, AbstractMesh


def lower_for_cuda(jitted, *args, **kwargs) -> str:
    """StableHLO text of `jitted(*args, **kwargs)` lowered for an H200; raises if any Triton module
    fails MLIR verification, asserts that at least one was built."""
    text, modules = lower_with_triton_modules(jitted, *args, **kwargs)
    assert modules and "triton" in text
    return text


def lower_with_triton_modules(jitted, *args, **kwargs) -> tuple[str, list[str]]:
    """-> (the StableHLO text, each Triton module's IR text) of `jitted(*args, **kwargs)` lowered for an
    H200 (bench/kernel_spills.py compiles the modules further with the triton wheel)."""
    built = []
    original = lowering.lower_jaxpr_to_triton_module

    def verified(*a, **k):
        result = original(*a, **k)
        result.module.operation.verify()  # raises MLIRError with the diagnostics
        built.append(str(result.module))
        return result

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                       platform="cuda"))
    with mock.patch.object(lowering, "lower_jaxpr_to_triton_module", verified), jax.sharding.use_abstract_mesh(mesh):
        text = jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
    return text, built
