"""The quantized grouped matmul's implementations: ``reference`` (jnp), ``triton`` (Pallas), ``config`` (tiling)."""
