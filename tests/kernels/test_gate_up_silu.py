"""The fused gate/up + silu * mul Triton kernel vs torch on the same weights (fresh random inputs).

On CPU it runs in the Triton interpreter on small shapes; on a GPU, compiled, also at the 8B shape."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tests.kernels.interpreter import interpreter_shims  # noqa: E402

interpreter_shims()

from splitserve.layers import gate_up_silu as fused  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 math on the same (16-bit) inputs."""
    gu = x.float() @ weight.float().t()
    n = weight.shape[0] // 2
    return torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 37, 130])
def test_small_shapes_match_torch(rows, dtype):
    # The engine's tile configuration and a small one; row counts that leave a partial row block.
    torch.manual_seed(rows)
    n, k = 256, 128
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    w = (torch.randn(2 * n, k, device=DEVICE) * 0.1).to(dtype)
    ref = reference(x, w)
    for config in (fused._CONFIG, (32, 64, 32, 4, 2)):
        out = fused.gate_up_silu_triton(x, w, config)
        assert out.shape == (rows, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_custom_op_and_empty_input():
    torch.manual_seed(0)
    x = torch.randn(5, 128, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(256, 128, device=DEVICE) * 0.1).to(torch.bfloat16)
    torch.testing.assert_close(fused.gate_up_silu(x, w).float(), reference(x, w), atol=2e-2, rtol=2e-2)
    assert fused.gate_up_silu_triton(x[:0], w).shape == (0, 128)


def test_supported_only_for_16_bit_cuda_tile_aligned_weights():
    w = torch.empty(256, 128, dtype=torch.bfloat16)
    assert not fused.supported(w)  # on the host
    if torch.cuda.is_available():
        assert fused.supported(w.cuda())
        assert not fused.supported(w.cuda().float())       # fp32 stays on cuBLAS
        assert not fused.supported(w[:, :96].cuda())       # K not a multiple of the tile
        assert not fused.supported(torch.empty(2 * 200, 128, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 8B shape needs a GPU")
def test_8b_shape_on_the_gpu():
    torch.manual_seed(1)
    for rows in (1024, 3000):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2 * 14336, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
        torch.testing.assert_close(fused.gate_up_silu(x, w).float(), reference(x, w), atol=2e-2, rtol=2e-2)
