"""The many-token W4A16 / W8A16 kernel (kernels/gemm/wna16/wna16_tiled.py) vs plain torch.

Two references: the fp32 matmul of the dequantized weight (the meaning), and today's large-M path,
the dequantize kernel's weight in the activation dtype times x in fp32: the tiled kernel dequantizes
to the same bits, so the two differ by the order of the sum and the output rounding only.
Kernels run in the Triton interpreter on CPU.
"""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.kernels.gemm import reference as R  # noqa: E402
from splitserve.kernels.gemm.tiles import TileConfig  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_gemm as W  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_layout as L  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_tiled as T  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_weight(N, K, bits, G, asym, scale_dtype=torch.float32):
    w = L.quantize_rtn(torch.randn(N, K, device=DEVICE) * 0.05, bits, G, symmetric=not asym)
    w.scales = (w.scales * (1 + torch.rand_like(w.scales))).to(scale_dtype)  # not a power-of-two grid
    return w


def check(out, x, w, bits, G, bias, dtype):
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    ref = R.wna16_gemm_ref(x, w.qweight, w.scales, w.zeros, bits=bits, group_size=G, bias=bias)
    assert rel_err(out, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3)
    # today's path: the weight rounded to the activation dtype by the dequantize kernel
    w_kn = W.wna16_dequantize(w.qweight, w.scales, w.zeros, bits=bits, group_size=G, dtype=dtype)
    today = x.float() @ w_kn.float() + (0 if bias is None else bias.float())
    ulp = today.abs().max().item() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
    assert (out.float() - today).abs().max().item() <= ulp


@pytest.mark.parametrize("swap", [False, True], ids=["x_w", "swap_ab"])
@pytest.mark.parametrize("bits,G,asym,dtype,scale_dtype", [
    (4, 128, False, torch.bfloat16, torch.float32), (4, 32, True, torch.bfloat16, torch.float32),
    (4, 64, True, torch.float16, torch.float16), (8, 64, False, torch.bfloat16, torch.bfloat16),
    (8, 128, True, torch.float16, torch.float32)])
def test_tiled_matches_reference(swap, bits, G, asym, dtype, scale_dtype):
    M, N, K = 37, 80, 256  # M and N tails: 2 M tiles of 32 (the second partial), 2 N tiles of 64
    x = torch.randn(M, K, device=DEVICE, dtype=dtype)
    w = random_weight(N, K, bits, G, asym, scale_dtype)
    bias = torch.randn(N, device=DEVICE, dtype=dtype) if asym else None
    cfg = TileConfig(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=2, swap_ab=swap)
    out = T.wna16_tiled_gemm(x, w.qweight, w.scales, w.zeros, bits=bits, group_size=G, bias=bias, config=cfg)
    assert out.shape == (M, N)
    check(out, x, w, bits, G, bias, dtype)


def test_tiled_block_k_equal_to_group_and_default_config():
    M, N, K, G = 20, 64, 128, 32
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    w = random_weight(N, K, 4, G, True)
    bias = torch.randn(N, device=DEVICE, dtype=torch.bfloat16)
    cfg = TileConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)  # one group per K tile
    out = T.wna16_tiled_gemm(x, w.qweight, w.scales, w.zeros, bits=4, group_size=G, bias=bias, config=cfg)
    check(out, x, w, 4, G, bias, torch.bfloat16)
    out = T.wna16_tiled_gemm(x, w.qweight, w.scales, w.zeros, bits=4, group_size=G, bias=bias)  # default tiles
    check(out, x, w, 4, G, bias, torch.bfloat16)


def test_tiled_errors_and_route(monkeypatch):
    w = random_weight(32, 128, 4, 64, False)
    x = torch.randn(4, 128, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_k"):
        T.wna16_tiled_gemm(x, w.qweight, w.scales, None, bits=4, group_size=64,
                           config=TileConfig(block_m=16, block_n=32, block_k=128, num_stages=3))
    assert W.wna16_route(W.WNA16_TILED_MAX_M) == "tiled"  # 256 from the H100 sweep
    assert W.wna16_route(W.WNA16_TILED_MAX_M + 1) == "dequant"
    monkeypatch.setattr(W, "WNA16_TILED_MAX_M", 1024)
    assert W.wna16_route(64) == "split_k"
    assert W.wna16_route(65) == W.wna16_route(1024, has_zeros=True) == W.wna16_route(256, bits=8) == "tiled"
    assert W.wna16_route(1025) == "dequant"
    assert W.wna16_route(256, has_perm=True) == "dequant"  # act-order stays on dequantize + cuBLAS
    assert W.wna16_route(256, N=200) == "dequant"  # N % 16: Triton 3.6 cannot compile the kernel
    with pytest.raises(ValueError, match="multiple of 16"):
        T.wna16_tiled_gemm(x, w.qweight[:, :24], w.scales[:, :24], None, bits=4, group_size=64)


def test_tiled_route_needs_hopper():
    """The tiled route runs wna16_wgmma.py's Gluon kernel, Hopper only: elsewhere (here, CPU tensors)
    _tiled declines and wna16_linear dequantizes for cuBLAS, since the Triton twin is slower than that."""
    w = random_weight(48, 256, 4, 128, True)
    x = torch.randn(70, 256, device=DEVICE, dtype=torch.bfloat16)
    assert W._tiled(x, w.qweight, w.scales, w.zeros, bits=4, group_size=128, bias=None) is None
