"""Pallas (Triton backend) kernels, installed as `weaver_jax.pallas_kernels`.

Each kernel lives beside its pure-JAX reference and wrapper, behind one module boundary. Tree
attention and the acceptance walk arrive with the verification work (see the project's issues);
until then every path in `weaver_jax` uses XLA.
"""
