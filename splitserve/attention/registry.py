"""Attention backends by name. The one module that imports the backends: backend.py defines only the
interface they implement, so it never imports them back (no import cycle)."""
from __future__ import annotations

from splitserve.attention.backend import AttentionBackend


def get_backend(name: str) -> AttentionBackend:
    # Imported on demand: the Triton backend imports triton, which a CPU engine never needs.
    if name == "torch_ref":
        from splitserve.attention.torch_ref import TorchRefBackend
        return TorchRefBackend()
    if name == "triton":
        from splitserve.attention.triton_backend import TritonBackend
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch_ref' or 'triton'")
