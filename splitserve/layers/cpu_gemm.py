"""Dense float matmul for the batchful part: `F.linear`, except on CPU where a wide weight with few
rows runs faster in column blocks (the unquantized linear method and the LM head use it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# On CPU, MKL's fp32 GEMM with few rows (a decode step: one row per sequence) runs a wide weight
# slower than the same weight in blocks of ~1k output columns (measured on the CI's 2-core AVX2 EPYC,
# one thread, 16 rows: the 3072-wide gate_up 13% faster, the 49k-wide LM head 27%). Each output is
# the same dot product either way (the results were bit-identical there). With one row MKL takes its
# matrix-vector path, which blocks only slow down; with hundreds of rows (prefill) blocks gain nothing.
CPU_COLUMN_BLOCK = 1024
CPU_BLOCKED_ROWS = (2, 128)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on CPU in column blocks where that is faster (see above)."""
    n = weight.shape[0]
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (x.device.type != "cpu" or n < 2 * CPU_COLUMN_BLOCK or not CPU_BLOCKED_ROWS[0] <= rows <= CPU_BLOCKED_ROWS[1]
            or torch.compiler.is_compiling() or torch.compiler.is_exporting()):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    out = x2.new_empty(rows, n)
    for start in range(0, n, CPU_COLUMN_BLOCK):
        end = min(start + CPU_COLUMN_BLOCK, n)
        out[:, start:end] = F.linear(x2, weight[start:end], None if bias is None else bias[start:end])
    return out.view(*x.shape[:-1], n)
