from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
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
        if torch.compiler.is_compiling():
            # The same sum (a half-precision add rounds the fp32 sum once), spelled so that Inductor
            # does not rewrite `matmul + residual` into cuBLAS addmm: that first copies the residual
            # into its output, a device-to-device copy of [tokens, hidden] per layer. Kept pointwise,
            # the add fuses into this norm's kernel. (Eagerly the plain add is one kernel, not four.)
            x = (x.float() + residual.float()).to(x.dtype)
        else:
            x = x + residual
        return self._norm(x), x
