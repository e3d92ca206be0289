"""The skinny decode matmul vs torch on fresh random inputs (Triton interpreter on CPU)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from splitserve.layers.gemv import gemv, gemv_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("N,K", [(40, 256), (96, 1024), (130, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_torch(M, N, K, dtype):
    torch.manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    w = torch.randn(N, K, dtype=dtype, device=DEVICE) * 0.05
    got = gemv(x, w, block_n=32, block_k=128, num_stages=1)
    ref = (x.float() @ w.float().T)
    assert got.dtype == dtype and got.shape == (M, N)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), ref, atol=tol, rtol=tol)


def test_split_k_covers_k_exactly():
    # Every split count chosen must cover K once: sum over splits of their ranges == K.
    for N, K in [(4096, 4096), (4096, 14336), (128256, 4096), (40, 256)]:
        block_n, block_k, split, per = gemv_config(N, K, num_sms=132)
        assert (split - 1) * per < K <= split * per and per % block_k == 0
