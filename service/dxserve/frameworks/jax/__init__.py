"""JAX behind the ``Framework`` seam: everything of dxserve that imports JAX."""
