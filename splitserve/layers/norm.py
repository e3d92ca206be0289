"""Normalisations on the flat token stream, all with one contract: `norm(x)` is the normalised x, and
`norm(x, residual)` is the pre-norm block's pair (norm(x + residual), x + residual), so a decoder
layer adds its residual inside the next norm's kernel whatever the family's norm is."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def add_residual(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # The same sum (a half-precision add rounds the fp32 sum once), spelled so that Inductor
        # does not rewrite `matmul + residual` into cuBLAS addmm: that first copies the residual
        # into its output, a device-to-device copy of [tokens, hidden] per layer. Kept pointwise,
        # the add fuses into the norm's kernel. (Eagerly the plain add is one kernel, not four.)
        return (x.float() + residual.float()).to(x.dtype)
    return x + residual


class RMSNorm(nn.Module):
    """Llama's RMSNorm: weight * (x / rms(x)), the normalised x rounded to x's dtype before the
    weight multiplies it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        orig = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(orig)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual: returns (norm(x + residual), x + residual), the pre-norm block's pair."""
        if residual is None:
            return self._norm(x)
        x = add_residual(x, residual)
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w - 1 (zeros mean identity) and the product
    (x / rms(x)) * (1 + w) is taken in fp32, rounded once at the end."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(RMSNorm):
    """LayerNorm with a bias (OPT, Persimmon, StableLM) under the same (x, residual) contract."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class LayerNorm1P(LayerNorm):
    """Nemotron's LayerNorm1P: the checkpoint stores w - 1 (as Gemma's RMSNorm does), so the scale
    is (1 + w); with a bias."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight + 1.0, self.bias, self.eps)
