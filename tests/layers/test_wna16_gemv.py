"""The decode GEMV for weight-only int4/int8 (kernels/gemm/wna16/wna16_gemv.py) vs the plain torch
reference (kernels/gemm/reference.py), on fresh random weights and activations.

Shapes are small (the kernels run in the Triton interpreter on CPU) but cover what the kernel
treats apart: a partial last N tile and N a multiple of the tile (unmasked loads), K not a multiple
of the split, 1..8 rows of x, 4 and 8 bits, symmetric and zero points, group sizes 32/64/128 and
per channel, act-order, bf16 and fp16, bias, and x rows that are not 4-byte aligned.
"""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.kernels.gemm import reference as R  # noqa: E402
from splitserve.kernels.gemm import tiles  # noqa: E402
from splitserve.kernels.gemm.tiles import TileConfig  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_gemm as W  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_gemv as V  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_layout as L  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_matches_reference(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out.float()).all()
    # the kernel computes in fp32: what is left is the output's rounding to 16 bits
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < (4e-3 if dtype == torch.bfloat16 else 1e-3), err
    torch.testing.assert_close(out.float(), ref, rtol=1 / 64, atol=2e-3 * ref.abs().max().item())


def weight(N, K, bits, G, asym):
    return L.quantize_rtn(torch.randn(N, K, device=DEVICE) * 0.05, bits, G, symmetric=not asym)


def run_and_check(M, N, K, bits, G, asym, dtype, *, perm=False, bias=False, config=None):
    w = weight(N, K, bits, G, asym)
    x = torch.randn(M, K, device=DEVICE, dtype=dtype)
    p = torch.randperm(K, device=DEVICE).to(torch.int32) if perm else None
    b = torch.randn(N, device=DEVICE, dtype=dtype) if bias else None
    out = V.wna16_gemv(x, w.qweight, w.scales, w.zeros, bits=bits, group_size=w.group_size, perm=p, bias=b,
                       config=config)
    ref = R.wna16_gemm_ref(x, w.qweight, w.scales, w.zeros, bits=bits, group_size=w.group_size, perm=p, bias=b)
    assert_matches_reference(out, ref, dtype)


# block_n 32 over N = 80: three N tiles, the last one partial; split 3 over K = 256 in K tiles of
# 32: slices of 96, 96 and 64 values
SPLIT3 = TileConfig(block_n=32, block_k=32, split_k=3, num_warps=1, num_stages=1)


@pytest.mark.parametrize("bits,G,asym,dtype,M", [
    (4, 128, False, torch.bfloat16, 1),
    (4, 32, True, torch.float16, 3),
    (4, 64, True, torch.bfloat16, 2),
    (8, 64, False, torch.float16, 1),
    (8, 128, True, torch.bfloat16, 4),
    (4, -1, False, torch.float16, 2),   # per channel: one group of K
    (8, -1, True, torch.bfloat16, 1),
])
def test_gemv_matches_reference(bits, G, asym, dtype, M):
    run_and_check(M, 80, 256, bits, G, asym, dtype, bias=True, config=SPLIT3)


@pytest.mark.parametrize("bits,asym,dtype", [(4, True, torch.bfloat16), (8, False, torch.float16)])
def test_gemv_act_order(bits, asym, dtype):
    run_and_check(3, 80, 256, bits, 64, asym, dtype, perm=True, config=SPLIT3)


@pytest.mark.parametrize("bits,dtype", [(4, torch.bfloat16), (8, torch.float16)])
def test_gemv_prefetch(bits, dtype):
    # the next K tile's words loaded ahead: the last tile of each slice must not read past it
    cfg = TileConfig(block_n=32, block_k=32, split_k=3, num_warps=1, num_stages=1, prefetch=True)
    run_and_check(2, 80, 256, bits, 64, True, dtype, bias=True, config=cfg)


def test_gemv_eight_rows_even_n_no_split():
    # N a multiple of block_n (unmasked loads), one K slice (no split-K), the most rows allowed
    run_and_check(8, 64, 128, 4, 32, True, torch.bfloat16,
                  config=TileConfig(block_n=32, block_k=32, split_k=1, num_warps=1, num_stages=1))


def test_gemv_default_config_and_counter_reuse():
    # the default tile choice (split-K over 32 values per slice), then the same launch again: the
    # split-K counters must have reset themselves
    N, K, G = 96, 512, 128
    w = weight(N, K, 4, G, False)
    cfg = tiles.wna16_gemv_tiles(1, N, K, 4, G)
    assert cfg.split_k > 1
    for _ in range(2):
        x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16)
        out = V.wna16_gemv(x, w.qweight, w.scales, None, bits=4, group_size=G)
        assert_matches_reference(out, R.wna16_gemm_ref(x, w.qweight, w.scales, None, bits=4, group_size=G),
                                 torch.bfloat16)


def test_gemv_unaligned_and_strided_x():
    # x rows read as 32-bit pairs: a view starting at an odd element, and a row stride, must still work
    N, K, G = 48, 128, 64
    w = weight(N, K, 4, G, True)
    odd = torch.randn(2, 2 * K + 1, device=DEVICE, dtype=torch.float16)
    even = torch.randn(2, 2 * K, device=DEVICE, dtype=torch.float16)
    for x in (odd[:, 1:K + 1], odd[:, K + 1:], even[:, K:]):  # the last one is read in place
        assert x.stride(1) == 1
        out = V.wna16_gemv(x, w.qweight, w.scales, w.zeros, bits=4, group_size=G, config=SPLIT3)
        assert_matches_reference(out, R.wna16_gemm_ref(x, w.qweight, w.scales, w.zeros, bits=4, group_size=G),
                                 torch.float16)


def test_gemv_errors():
    w = weight(64, 128, 4, 32, False)
    x = torch.randn(2, 128, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most"):
        V.wna16_gemv(torch.randn(9, 128, device=DEVICE, dtype=torch.bfloat16), w.qweight, w.scales, None,
                     bits=4, group_size=32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        V.wna16_gemv(x.float(), w.qweight, w.scales, None, bits=4, group_size=32)
    with pytest.raises(ValueError, match="packs K"):
        V.wna16_gemv(x[:, :64], w.qweight, w.scales, None, bits=4, group_size=32)
    with pytest.raises(ValueError, match="block_k"):
        V.wna16_gemv(x, w.qweight, w.scales, None, bits=4, group_size=32,
                     config=TileConfig(block_n=32, block_k=64, num_stages=1))
    with pytest.raises(ValueError, match="bias"):
        V.wna16_gemv(x, w.qweight, w.scales, None, bits=4, group_size=32,
                     bias=torch.zeros(3, device=DEVICE, dtype=torch.bfloat16))
    assert V.wna16_gemv(x[:0], w.qweight, w.scales, None, bits=4, group_size=32).shape == (0, 64)


def test_wna16_linear_routes():
    assert [W.wna16_route(M) for M in (1, W.WNA16_GEMV_MAX_M, W.WNA16_GEMV_MAX_M + 1, W.WNA16_SPLIT_K_MAX_M,
                                        W.WNA16_DEQUANT_MIN_M, W.WNA16_TILED_MAX_M + 1)] == \
        ["gemv", "gemv", "split_k", "split_k", "tiled", "dequant"]
    # the GEMV only where it was measured faster: symmetric int4
    assert W.wna16_route(1, has_zeros=True) == "split_k" and W.wna16_route(1, bits=8) == "split_k"


@pytest.mark.skipif(DEVICE != "cuda", reason="off CUDA wna16_linear computes the torch reference")
def test_wna16_linear_takes_gemv_for_few_tokens(monkeypatch):
    calls = []
    real = W.wna16_gemv
    monkeypatch.setattr(W, "wna16_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    w = weight(64, 128, 4, 128, False)
    for M in (1, W.WNA16_GEMV_MAX_M, W.WNA16_GEMV_MAX_M + 1):
        x = torch.randn(M, 128, device=DEVICE, dtype=torch.bfloat16)
        out = W.wna16_linear(x, w.qweight, w.scales, None, bits=4, group_size=128)
        assert_matches_reference(out, R.wna16_gemm_ref(x, w.qweight, w.scales, None, bits=4, group_size=128),
                                 torch.bfloat16)
    assert calls == [1, W.WNA16_GEMV_MAX_M]
