"""FP8 activation quantization and GEMM kernels (kernels/gemm/fp8/fp8_gemm.py) vs the torch reference.

Without CUDA the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
with the interpreter's fp8/bf16 rounding fixed (tests/triton_interpreter_shims.py); shapes are small and odd
(M, N, K not multiples of the tiles) so masks, clamped rows and partial groups are exercised.
Every check draws fresh random inputs.
"""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.kernels.gemm import reference as R  # noqa: E402
from splitserve.kernels.gemm.fp8 import fp8_gemm as F  # noqa: E402
from splitserve.kernels.gemm.tiles import TileConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def assert_close_bf16(out, ref):
    """Kernel (fp32 accumulation, one rounding to bf16/fp16) vs reference (fp32, same rounding)."""
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref) < 4e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=1 / 64, atol=2e-3 * ref.float().abs().max().item())


def weights(N, K, kind, gen):
    w = torch.randn(N, K, generator=gen, device=DEVICE) * 0.05
    if kind == "tensor":
        s = w.abs().max() / 448
        return (w / s).to(FP8), s.reshape(())
    q, s = R.quantize_fp8_weight_ref(w, block=kind == "block")
    return q, s if kind == "block" else s.reshape(-1)  # per channel as [N]


@pytest.fixture
def gen():
    g = torch.Generator(device=DEVICE)
    g.manual_seed(torch.randint(0, 2**31, ()).item())
    return g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_per_token_matches_reference(dtype, gen):
    x = torch.randn(6, 300, generator=gen, device=DEVICE).to(dtype) * 3
    x[2] = 0  # an all-zero row gets the epsilon scale, not a division by zero
    q, s = F.quantize_fp8_per_token(x)
    q_ref, s_ref = R.fp8_quantize_ref(x)
    assert q.dtype == FP8 and s.shape == (6, 1)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # the definition itself: q * s reproduces x within e4m3's half-ulp (2^-4 relative; absolute
    # 2^-10 * s among the subnormals)
    assert ((q.float() * s - x.float()).abs() <= x.float().abs() / 16 + s * 2**-9).all()


def test_quantize_per_token_long_row_and_static_scale(gen):
    x = torch.randn(3, 5000, generator=gen, device=DEVICE, dtype=torch.bfloat16)  # > one 4096 block
    q, s = F.quantize_fp8_per_token(x)
    q_ref, s_ref = R.fp8_quantize_ref(x)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    static = torch.tensor([0.004], device=DEVICE)
    q, s = F.quantize_fp8_per_token(x, static)
    q_ref, _ = R.fp8_quantize_ref(x, static_scale=static)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and s.item() == pytest.approx(0.004)
    assert q.float().abs().max() == 448  # |x| > 1.8 does not fit this scale: clamped, not NaN


def test_quantize_per_group_partial_last_group(gen):
    x = torch.randn(5, 300, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    x[1, 128:256] = 0
    q, s = F.quantize_fp8_per_group(x)
    q_ref, s_ref = R.fp8_quantize_ref(x, group=128)
    assert s.shape == (5, 3)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_reference_is_close_to_the_dense_product(gen):
    # the reference's own sanity: FP8 W8A8 stays within a few percent of the unquantized product
    x = torch.randn(4, 512, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(64, 512, generator=gen, device=DEVICE) * 0.05
    dense = x.float() @ w.t()
    for block in (False, True):
        wq, ws = R.quantize_fp8_weight_ref(w, block=block)
        for act in ("token", "group", "none"):
            assert rel_err(R.fp8_linear_ref(x, wq, ws, act=act), dense) < 0.05


CONFIGS = [None, TileConfig(block_m=16, block_n=32, block_k=128, split_k=3),
           TileConfig(block_m=32, block_n=16, block_k=64, split_k=2, num_warps=2)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "split3", "bk64"])
@pytest.mark.parametrize("w_kind", ["channel", "tensor", "block"])
def test_fp8_gemm_fp8_activations(cfg, w_kind, gen):
    M, N, K = 5, 160, 320  # K % 128 != 0: the last K tile and group are partial
    x = torch.randn(M, K, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    wq, ws = weights(N, K, w_kind, gen)
    bias = torch.randn(N, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    for group in (None, 128):  # A_MODE 0 (per token) and 1 (per token and group)
        if group is None and w_kind == "block" and cfg is not None and cfg.block_k > 128:
            continue
        q, s = R.fp8_quantize_ref(x, group)
        out = F.fp8_gemm(q, s, wq, ws, bias, config=cfg)
        assert out.dtype == torch.bfloat16 and out.shape == (M, N)
        assert_close_bf16(out, R.fp8_gemm_ref(q, s, wq, ws, bias))


@pytest.mark.parametrize("cfg", [None, TileConfig(block_m=16, block_n=64, block_k=128, split_k=2)],
                         ids=["default", "split2"])
@pytest.mark.parametrize("act", ["group", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemm_fused_activation_modes(cfg, act, dtype, gen):
    M, N, K = 3, 96, 384
    x = torch.randn(M, K, generator=gen, device=DEVICE, dtype=dtype)
    for w_kind in ("channel", "block"):
        wq, ws = weights(N, K, w_kind, gen)
        out = F.fp8_gemm(x, None, wq, ws, config=cfg, act=act)
        assert out.dtype == dtype
        assert_close_bf16(out, R.fp8_linear_ref(x, wq, ws, act=act))


def test_split_k_counters_reset_between_calls(gen):
    # the same split-K tiles twice in a row: the second call must find its counters back at zero
    cfg = TileConfig(block_m=16, block_n=32, block_k=128, split_k=4)
    wq, ws = weights(64, 512, "channel", gen)
    for _ in range(2):
        x = torch.randn(2, 512, generator=gen, device=DEVICE, dtype=torch.bfloat16)
        assert_close_bf16(F.fp8_gemm(x, None, wq, ws, config=cfg, act="none"), R.fp8_linear_ref(x, wq, ws, act="none"))


def test_large_m_tile_path(gen):
    # block_m 128 (the block-scale prefill path) with more than one M tile
    M, N, K = 130, 128, 256
    x = torch.randn(M, K, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    wq, ws = weights(N, K, "block", gen)
    q, s = R.fp8_quantize_ref(x, 128)
    assert_close_bf16(F.fp8_gemm(q, s, wq, ws), R.fp8_gemm_ref(q, s, wq, ws))


def test_fp8_linear_dispatch_shapes_and_reference(gen):
    x = torch.randn(2, 3, 256, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    wq, ws = weights(64, 256, "channel", gen)
    bias = torch.randn(64, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    out = F.fp8_linear(x, wq, ws, bias)
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    ref = R.fp8_linear_ref(x.reshape(6, 256), wq, ws, bias, act=F.fp8_small_m_act(6)).reshape(2, 3, 64)
    assert_close_bf16(out, ref)
    static = torch.tensor(0.02, device=DEVICE)
    out = F.fp8_linear(x, wq, ws, input_scale=static)
    assert_close_bf16(out, R.fp8_linear_ref(x.reshape(6, 256), wq, ws, act="token", input_scale=static).reshape(2, 3, 64))


def test_bad_inputs_raise_value_errors(gen):
    x = torch.randn(2, 256, device=DEVICE, dtype=torch.bfloat16)
    wq, ws = weights(64, 256, "channel", gen)
    with pytest.raises(ValueError, match="K differs"):
        F.fp8_gemm(x, None, wq[:, :128], ws)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        F.fp8_gemm(x, None, wq.float(), ws)
    with pytest.raises(ValueError, match="weight scale of shape"):
        F.fp8_gemm(x, None, wq, ws[:10])
    with pytest.raises(ValueError, match="a_scale"):
        F.fp8_gemm(wq[:2], torch.ones(3, 5, device=DEVICE), wq, ws)
    with pytest.raises(ValueError, match="act must be"):
        F.fp8_gemm(x, None, wq, ws, act="token")
    with pytest.raises(ValueError, match="bias"):
        F.fp8_gemm(x, None, wq, ws, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="block_k"):
        F.fp8_gemm(x, None, wq, ws, config=TileConfig(block_m=16, block_n=16, block_k=256))
    with pytest.raises(ValueError, match="bf16/fp16"):
        F.fp8_linear(x.float(), wq, ws)
    with pytest.raises(ValueError, match="static activation scale"):
        F.quantize_fp8_per_token(x, torch.ones(2, device=DEVICE))
