"""The MLP's silu * mul Triton kernel vs torch on fresh random inputs (interpreter on CPU)."""
import pytest
import torch

from splitserve.layers.activation import silu_and_mul, silu_and_mul_torch
from splitserve.layers.silu_mul_kernel import silu_and_mul_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inter", [(5, 700), (3, 1024), (0, 64)])
def test_matches_torch(dtype, rows, inter):
    x = torch.randn(rows, 2 * inter, device=DEVICE).to(dtype) * 3
    ref = silu_and_mul_torch(x.float())
    out = silu_and_mul_triton(x)
    assert out.shape == (rows, inter) and out.dtype == dtype
    # fp32: sigmoid vs torch's silu differ in the last bits. 16-bit: one rounding of the fp32 result,
    # so at most one ulp from torch's (when the two fp32 values straddle a rounding boundary).
    rtol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=rtol, atol=1e-6)


def test_strided_rows():
    """The gate/up projection's output may be a row-strided view (e.g. a slice of a padded buffer)."""
    wide = torch.randn(4, 3 * 96, device=DEVICE)
    x = wide[:, :2 * 96]
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_torch(x), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the op dispatches to Triton on CUDA only")
def test_compiled_layers_use_the_op():
    """Inside torch.compile (dynamic shapes, as the engine compiles its layers) the op is opaque and
    gives the kernel's result."""
    x = torch.randn(37, 2 * 512, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: silu_and_mul(t) + 1, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(x), silu_and_mul_triton(x) + 1)
