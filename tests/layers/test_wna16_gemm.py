"""Weight-only int4/int8 GEMM (kernels/gemm/wna16/wna16_gemm.py) and its canonical layout
(wna16_layout.py) vs plain torch.

The checkpoint formats are packed here by loops written from each format's description (GPTQ,
AWQ, compressed-tensors), independent of the converters under test; the expected dense weight is
computed from the integers before packing. Kernels run in the Triton interpreter on CPU.
"""
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.kernels.gemm import reference as R  # noqa: E402
from splitserve.kernels.gemm.tiles import TileConfig  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_gemm as W  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_layout as L  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def rng():
    return np.random.default_rng(torch.randint(0, 2**31, ()).item())


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def assert_close_out(out, ref):
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref) < 4e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=1 / 64, atol=2e-3 * ref.float().abs().max().item())


def t(a, dtype=None):
    out = torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)
    return out if dtype is None else out.to(dtype)


def pack_loop(values, bits, axis, order=None):
    """uint values -> int32 words along `axis`: bits [bits*j, bits*j + bits) of word i hold element
    P*i + order[j] (natural order, P*i + j, unless given)."""
    P = 32 // bits
    order = order or list(range(P))
    v = np.moveaxis(values.astype(np.uint64), axis, 0)
    words = np.zeros((v.shape[0] // P,) + v.shape[1:], dtype=np.uint64)
    for i in range(words.shape[0]):
        for j in range(P):
            words[i] |= v[i * P + order[j]] << np.uint64(bits * j)
    return np.moveaxis(words.astype(np.uint32).view(np.int32), 0, axis)


def random_ints(rng, N, K, G, bits, asym):
    q = rng.integers(0, 1 << bits, size=(N, K))
    z = rng.integers(0, 1 << bits, size=(K // G, N)) if asym else np.full((K // G, N), 1 << (bits - 1))
    s = (rng.random((K // G, N)) * 0.02 + 0.001).astype(np.float32)
    return q, z, s


# ---------------------------------------------------------------------------------------------
# layout conversions
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
def test_pack_roundtrip_and_canonical_word_order(bits, rng):
    q = rng.integers(0, 1 << bits, size=(24, 64))
    packed = L.pack_qweight(t(q, torch.int32), bits)
    assert packed.shape == (64 // (32 // bits), 24) and packed.dtype == torch.int32
    # the documented canonical order: 4-bit words interleave K offsets 0, 2, 4, 6, 1, 3, 5, 7
    canonical = [0, 2, 4, 6, 1, 3, 5, 7] if bits == 4 else None
    assert np.array_equal(packed.cpu().numpy(), pack_loop(q.T, bits, axis=0, order=canonical))
    assert torch.equal(L.unpack_qweight(packed, bits).cpu(), torch.from_numpy(q).to(torch.int32))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits,asym", [(4, False), (4, True), (8, True)])
def test_from_gptq(bits, asym, fmt, act_order, rng):
    N, K, G = 32, 256, 64
    q, z, s = random_ints(rng, N, K, G, bits, asym)  # q in checkpoint K order
    g_idx = np.arange(K) // G
    if act_order:
        order = rng.permutation(K)
        g_idx = np.empty(K, dtype=np.int64)
        g_idx[order] = np.arange(K) // G  # channel order[i] belongs to group i // G
    dense = (q - z[g_idx].T) * s[g_idx].T  # [N, K], the checkpoint's meaning
    stored_z = (z - 1) & ((1 << bits) - 1) if fmt == "gptq" else z
    w = L.from_gptq(t(pack_loop(q.T, bits, 0)), t(pack_loop(stored_z, bits, 1)), t(s), bits=bits, group_size=G,
                    g_idx=t(g_idx, torch.int32), checkpoint_format=fmt)
    assert (w.perm is not None) == act_order and (w.zeros is not None) == asym
    torch.testing.assert_close(L.dense_in_original_order(w).cpu(), torch.from_numpy(dense).float(), rtol=0, atol=0)
    x = torch.randn(3, K, device=DEVICE, dtype=torch.bfloat16)
    out = W.wna16_gemm(x, w.qweight, w.scales, w.zeros, bits=bits, group_size=G, perm=w.perm)
    assert_close_out(out, x.float() @ t(dense).float().t())


@pytest.mark.parametrize("asym", [False, True])
def test_from_awq(asym, rng):
    N, K, G = 64, 128, 32
    q, z, s = random_ints(rng, N, K, G, 4, asym)
    dense = (q - np.repeat(z, G, 0).T) * np.repeat(s, G, 0).T

    def awq_pack(vals):  # [R, C] -> [R, C // 8], nibble j holds column 8 * w + AWQ_ORDER[j]
        out = np.zeros((vals.shape[0], vals.shape[1] // 8), dtype=np.uint32)
        for col in range(out.shape[1]):
            for j, c in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
                out[:, col] |= vals[:, col * 8 + c].astype(np.uint32) << (4 * j)
        return out.view(np.int32)

    w = L.from_awq(t(awq_pack(q.T)), t(awq_pack(z)), t(s, torch.float16), group_size=G)
    assert (w.zeros is not None) == asym and w.perm is None
    torch.testing.assert_close(L.dense_in_original_order(w).cpu(),
                               torch.from_numpy(dense).float(), rtol=2e-3, atol=0)  # fp16 scales
    x = torch.randn(2, K, device=DEVICE, dtype=torch.float16)
    out = W.wna16_gemm(x, w.qweight, w.scales, w.zeros, bits=4, group_size=G)
    assert_close_out(out, x.float() @ L.dense_in_original_order(w).t())


@pytest.mark.parametrize("zp", ["none", "unpacked", "packed"])
@pytest.mark.parametrize("bits", [4, 8])
def test_from_compressed_tensors(bits, zp, rng):
    N, K, G = 48, 256, 128
    half = 1 << (bits - 1)
    q_signed = rng.integers(-half, half, size=(N, K))
    zero = rng.integers(-half, half, size=(N, K // G)) if zp != "none" else np.zeros((N, K // G), dtype=np.int64)
    s = (rng.random((N, K // G)) * 0.02 + 0.001).astype(np.float32)
    dense = (q_signed - np.repeat(zero, G, 1)) * np.repeat(s, G, 1)
    kwargs = {}
    if zp == "unpacked":
        kwargs["weight_zero_point"] = t(zero, torch.int8)
    elif zp == "packed":
        kwargs["weight_zero_point"] = t(pack_loop(zero + half, bits, 0))  # packed along N
    w = L.from_compressed_tensors(t(pack_loop(q_signed + half, bits, 1)), t(s), bits=bits, group_size=G,
                                  weight_shape=(N, K), **kwargs)
    assert (w.zeros is not None) == (zp != "none")
    torch.testing.assert_close(L.dense_in_original_order(w).cpu(), torch.from_numpy(dense).float(), rtol=0, atol=0)


def test_compressed_tensors_actorder_and_channel_group(rng):
    N, K = 32, 128
    q_signed = rng.integers(-8, 8, size=(N, K))
    s = (rng.random((N, 1)) * 0.02 + 0.001).astype(np.float32)
    w = L.from_compressed_tensors(t(pack_loop(q_signed + 8, 4, 1)), t(s), bits=4, group_size=-1)
    assert w.group_size == K
    torch.testing.assert_close(L.dense_in_original_order(w).cpu(), torch.from_numpy(q_signed * s).float(),
                               rtol=0, atol=0)
    G = 32
    s = (rng.random((N, K // G)) * 0.02 + 0.001).astype(np.float32)
    order = rng.permutation(K)
    g_idx = np.empty(K, dtype=np.int64)
    g_idx[order] = np.arange(K) // G
    dense = q_signed * s[:, g_idx]
    w = L.from_compressed_tensors(t(pack_loop(q_signed + 8, 4, 1)), t(s), bits=4, group_size=G,
                                  weight_g_idx=t(g_idx, torch.int32))
    assert w.perm is not None
    torch.testing.assert_close(L.dense_in_original_order(w).cpu(), torch.from_numpy(dense).float(), rtol=0, atol=0)


def test_layout_errors(rng):
    w = L.quantize_rtn(torch.randn(16, 64), 4, 32)
    with pytest.raises(ValueError, match="group_size"):
        L.check_canonical(w.qweight, w.scales, None, 4, 48)
    with pytest.raises(ValueError, match="scales"):
        L.check_canonical(w.qweight, w.scales.t(), None, 4, 32)
    with pytest.raises(ValueError, match="bits"):
        L.check_canonical(w.qweight, w.scales, None, 3, 32)
    with pytest.raises(ValueError, match="zeros"):
        L.check_canonical(w.qweight, w.scales, torch.zeros(2, 16, dtype=torch.int32), 4, 32)
    bad_g_idx = torch.zeros(64, dtype=torch.int32)
    bad_g_idx[:40] = 1
    with pytest.raises(ValueError, match="g_idx"):
        L.from_gptq(w.qweight, torch.zeros(2, 2, dtype=torch.int32), w.scales, bits=4, group_size=32, g_idx=bad_g_idx)
    with pytest.raises(ValueError, match="pack"):
        L.pack_qweight(torch.full((4, 8), 16, dtype=torch.int32), 4)


def test_quantize_rtn_error_is_small():
    w = torch.randn(64, 256) * 0.05
    for bits, tol in ((4, 0.12), (8, 0.01)):
        for sym in (True, False):
            qw = L.quantize_rtn(w, bits, 64, sym)
            assert rel_err(L.dequantize(qw), w) < tol


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

CONFIGS = {
    "default": None,
    "split3": TileConfig(block_m=16, block_n=32, block_k=32, split_k=3),
    "bcast": TileConfig(block_m=16, block_n=32, block_k=64, split_k=2, unpack_bcast=True),
    "tiled": TileConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2),
}


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("bits,G,asym,dtype", [
    (4, 128, False, torch.bfloat16), (4, 32, True, torch.bfloat16), (4, 64, True, torch.float16),
    (8, 64, False, torch.bfloat16), (8, 128, True, torch.float16)])
def test_wna16_gemm_matches_reference(cfg, bits, G, asym, dtype):
    M, N, K = 5, 80, 256  # N % 32 != 0: the last N tile is partial
    x = torch.randn(M, K, device=DEVICE, dtype=dtype)
    w = L.quantize_rtn(torch.randn(N, K, device=DEVICE) * 0.05, bits, G, symmetric=not asym)
    bias = torch.randn(N, device=DEVICE, dtype=dtype)
    perm = torch.randperm(K, device=DEVICE).to(torch.int32) if cfg == "split3" else None
    c = CONFIGS[cfg]
    if c is not None and G % c.block_k:
        c = replace(c, block_k=G)
    out = W.wna16_gemm(x, w.qweight, w.scales, w.zeros, bits=bits, group_size=G, perm=perm, bias=bias, config=c)
    assert out.dtype == dtype and out.shape == (M, N)
    ref = R.wna16_gemm_ref(x, w.qweight, w.scales, w.zeros, bits=bits, group_size=G, perm=perm, bias=bias)
    assert_close_out(out, ref)


def test_wna16_more_m_tiles_and_counter_reuse():
    K, N, G = 128, 64, 64
    w = L.quantize_rtn(torch.randn(N, K, device=DEVICE) * 0.05, 4, G, symmetric=False)
    for M in (17, 33):  # two M tiles of 16 / 32 rows, split-K both times
        x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
        cfg = TileConfig(block_m=16 if M == 17 else 32, block_n=32, block_k=32, split_k=4)
        out = W.wna16_gemm(x, w.qweight, w.scales, w.zeros, bits=4, group_size=G, config=cfg)
        assert_close_out(out, R.wna16_gemm_ref(x, w.qweight, w.scales, w.zeros, bits=4, group_size=G))


@pytest.mark.parametrize("bits,asym", [(4, True), (8, False)])
def test_wna16_dequantize_kernel(bits, asym):
    w = L.quantize_rtn(torch.randn(96, 192, device=DEVICE) * 0.05, bits, 64, symmetric=not asym)
    out = W.wna16_dequantize(w.qweight, w.scales, w.zeros, bits=bits, group_size=64, dtype=torch.float32)
    ref = R.wna16_dequant_ref(w.qweight, w.scales, w.zeros, bits=bits, group_size=64).t()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)


def test_wna16_linear_dispatch_and_errors():
    w = L.quantize_rtn(torch.randn(64, 128, device=DEVICE) * 0.05, 4, 128)
    x = torch.randn(2, 3, 128, device=DEVICE, dtype=torch.bfloat16)
    out = W.wna16_linear(x, w.qweight, w.scales, w.zeros, bits=4, group_size=128)
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    ref = R.wna16_gemm_ref(x.reshape(6, 128), w.qweight, w.scales, w.zeros, bits=4, group_size=128)
    assert_close_out(out.reshape(6, 64), ref)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        W.wna16_gemm(x.reshape(6, 128).float(), w.qweight, w.scales, w.zeros, bits=4, group_size=128)
    with pytest.raises(ValueError, match="packs K"):
        W.wna16_gemm(x.reshape(6, 128)[:, :64], w.qweight, w.scales, w.zeros, bits=4, group_size=128)
    with pytest.raises(ValueError, match="block_k"):
        W.wna16_gemm(x.reshape(6, 128), w.qweight, w.scales, w.zeros, bits=4, group_size=128,
                     config=TileConfig(block_m=16, block_n=32, block_k=96))
    with pytest.raises(ValueError, match="bias"):
        W.wna16_gemm(x.reshape(6, 128), w.qweight, w.scales, w.zeros, bits=4, group_size=128,
                     bias=torch.zeros(3, device=DEVICE, dtype=torch.bfloat16))
