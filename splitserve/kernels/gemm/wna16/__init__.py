"""WNA16 kernels; see kernels/gemm/__init__.py."""
