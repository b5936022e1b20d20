"""Pallas (Triton backend) kernels, installed as `weaver_jax.pallas_kernels`.

Each kernel lives beside its pure-JAX reference and wrapper in one module:
  tree_attention: verification's attention of N tree nodes over the committed prefix (split
    across programs, grouped query heads sharing K/V loads) plus the tree's own K/V under the
    ancestor mask. Tested in interpret mode and lowered for CUDA in the CPU suite; not yet wired
    into the target's forward (every path in `weaver_jax` still uses XLA) until it is timed on a GPU.
"""
