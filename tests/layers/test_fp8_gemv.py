"""The FP8-weight GEMV (kernels/gemm/fp8/fp8_gemv.py, W8A16 at 1-2 tokens) vs the torch reference, and
fp8_linear's dispatch to it.

Without CUDA the kernel runs in the Triton interpreter (tests/conftest.py); shapes are small, with N
and K tails (rows past N, a partial last K step) and split-K on and off. Fresh random inputs each time.
"""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.kernels.gemm import reference as R  # noqa: E402
from splitserve.kernels.gemm.fp8 import fp8_gemm as F  # noqa: E402
from splitserve.kernels.gemm.fp8 import fp8_gemv as G  # noqa: E402
from splitserve.kernels.gemm.tiles import TileConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def assert_close(out, ref):
    """fp32 accumulation in the kernel and in the reference; one rounding to bf16/fp16 on each side."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref) < 4e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=1 / 64, atol=2e-3 * ref.float().abs().max().item())


def weights(N, K, per_tensor, gen):
    w = torch.randn(N, K, generator=gen, device=DEVICE) * 0.05
    if per_tensor:
        s = w.abs().max() / 448
        return (w / s).to(FP8), s.reshape(())
    q, s = R.quantize_fp8_weight_ref(w)
    return q, s.reshape(-1)


@pytest.fixture
def gen():
    g = torch.Generator(device=DEVICE)
    g.manual_seed(torch.randint(0, 2**31, ()).item())
    return g


# (N, K, config): N tails (N not a multiple of block_n), K tails (K not a multiple of block_k or of the
# 8-value runs), split-K off / on (several K steps per split, a partial last split)
CASES = [
    (48, 256, TileConfig(block_n=16, block_k=64, split_k=1, num_warps=1, num_stages=1)),
    (40, 200, TileConfig(block_n=16, block_k=64, split_k=1, num_warps=1, num_stages=1)),
    (33, 300, TileConfig(block_n=16, block_k=64, split_k=3, num_warps=2, num_stages=1)),
    (64, 512, TileConfig(block_n=32, block_k=128, split_k=2, num_warps=4, num_stages=1)),
    (24, 130, TileConfig(block_n=8, block_k=32, split_k=4, num_warps=1, num_stages=1, prefetch=True)),
    (32, 512, TileConfig(block_n=16, block_k=64, split_k=2, num_warps=2, num_stages=1, prefetch=True)),
]


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K,cfg", CASES)
def test_fp8_gemv_matches_reference(M, dtype, N, K, cfg, gen):
    per_tensor = cfg.block_n == 16  # both scale layouts, spread over the cases
    w, s = weights(N, K, per_tensor, gen)
    x = torch.randn(M, K, generator=gen, device=DEVICE).to(dtype)
    bias = torch.randn(N, generator=gen, device=DEVICE).to(dtype) if N % 2 == 0 else None
    out = G.fp8_gemv(x, w, s, bias, config=cfg)
    assert_close(out, R.fp8_gemv_ref(x, w, s, bias))


@pytest.mark.parametrize("scale_shape", ["[1]", "[N, 1]"])
def test_fp8_gemv_scale_layouts_and_default_config(scale_shape, gen):
    N, K = 64, 384
    w, s = weights(N, K, scale_shape == "[1]", gen)
    s = s.reshape(1) if scale_shape == "[1]" else s.reshape(N, 1)
    x = torch.randn(2, K, generator=gen, device=DEVICE).to(torch.bfloat16)
    assert_close(G.fp8_gemv(x, w, s), R.fp8_gemv_ref(x, w, s))


def test_fp8_gemv_rejects_what_it_cannot_run(gen):
    w, s = weights(32, 128, False, gen)
    x = torch.randn(3, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="at most"):
        G.fp8_gemv(x, w, s)
    with pytest.raises(ValueError, match="per-tensor or per-channel"):
        G.fp8_gemv(x[:1], w, torch.ones(1, 1, device=DEVICE).expand(1, 2).contiguous())
    with pytest.raises(ValueError, match="power of two"):
        G.fp8_gemv(x[:1], w, s, config=TileConfig(block_n=16, block_k=48, num_stages=1))


def test_fp8_linear_routes_few_tokens_to_the_gemv(monkeypatch, gen):
    """With FP8_GEMV_MAX_M >= M, per-channel / per-tensor scales and no static input scale, fp8_linear
    computes W8A16 (off CUDA: the reference with act "none"); block scales and static input scales
    keep the W8A8 path, as do more tokens."""
    N, K = 32, 256
    w, s = weights(N, K, False, gen)
    x = torch.randn(2, K, generator=gen, device=DEVICE).to(torch.bfloat16)
    monkeypatch.setattr(F, "FP8_GEMV_MAX_M", 2)
    assert F.fp8_route(2, 1, None) == "gemv" and F.fp8_route(3, 1, None) != "gemv"
    assert F.fp8_route(1, 2, None) != "gemv" and F.fp8_route(1, 0, torch.ones(1)) != "gemv"
    assert_close(F.fp8_linear(x, w, s), R.fp8_gemv_ref(x, w, s))
    monkeypatch.setattr(F, "FP8_GEMV_MAX_M", 0)
    assert F.fp8_route(1, 1, None) != "gemv"
    assert_close(F.fp8_linear(x, w, s), R.fp8_linear_ref(x, w, s, act=F.fp8_small_m_act(2)))


def test_fp8_method_asks_for_one_row_only_with_the_gemv_route(monkeypatch):
    """The decode graph of one sequence (LinearMethod.cheaper_at_one_row) exists when fp8_linear would run
    the GEMV at one token: dynamic activations, per-channel / per-tensor weights, the FP8 matmul on."""
    from splitserve.layers.linear import Linear
    from splitserve.layers.quantization.fp8 import Fp8Config

    layer = Linear(128, 64, method=Fp8Config.online().linear_method(["x"]))
    layer.weight.data.normal_()
    layer.process_weights_after_loading()
    monkeypatch.setattr(F, "FP8_GEMV_MAX_M", 2)
    assert not layer.method.cheaper_at_one_row(layer)  # on CPU: emulated, no kernel
    layer.fp8_scaled_mm = True  # as on CUDA
    assert layer.method.cheaper_at_one_row(layer)
    monkeypatch.setattr(F, "FP8_GEMV_MAX_M", 0)
    assert not layer.method.cheaper_at_one_row(layer)
    block = Fp8Config.from_checkpoint({"weight_block_size": [128, 128]}).linear_method(["x"])
    monkeypatch.setattr(F, "FP8_GEMV_MAX_M", 2)
    layer_b = Linear(128, 128, method=block)
    layer_b.method.init_random(layer_b, torch.Generator().manual_seed(0))
    layer_b.process_weights_after_loading()
    layer_b.fp8_scaled_mm = True
    assert not layer_b.method.cheaper_at_one_row(layer_b)
