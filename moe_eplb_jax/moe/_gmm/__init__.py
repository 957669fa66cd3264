"""Backends of ``moe_eplb_jax.moe.grouped_matmul``: the jnp reference, Pallas Triton and Pallas Mosaic GPU kernels."""
