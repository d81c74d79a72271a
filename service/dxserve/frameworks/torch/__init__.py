"""PyTorch behind the ``Framework`` seam: everything of dxserve that imports torch."""
