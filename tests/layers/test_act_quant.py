"""silu(gate) * up fused with per-token fp8 / int8 quantization (kernels/gemm/act_quant.py), the FP8 and
INT8 methods' fused down projection, and GatedMLP's use of it.

Without CUDA the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1,
tests/triton_interpreter_shims.py fixes its fp8/bf16 rounding). References: h = silu(g) * u in fp32
rounded once (reference.silu_mul_ref: what Inductor computes for silu_and_mul), the existing per-token
quantizers, and the unfused layer computation. Every check draws fresh random inputs.
"""
import contextlib

import pytest
import torch
import transformers

from tests import triton_interpreter_shims
from tests.quant_reference import random_quantized_weights

triton_interpreter_shims.install()

from splitserve.kernels.gemm import act_quant as A  # noqa: E402
from splitserve.kernels.gemm import reference as R  # noqa: E402
from splitserve.kernels.gemm.fp8 import fp8_gemm as F8  # noqa: E402
from splitserve.kernels.gemm.int8 import int8_gemm as I8  # noqa: E402
from splitserve.layers.activation import silu_and_mul  # noqa: E402
from splitserve.layers.quantization import ops  # noqa: E402
from splitserve.layers.quantization.base import QuantConfig  # noqa: E402
from splitserve.layers.quantization.fp8 import Fp8Config  # noqa: E402
from splitserve.layers.quantization.int8 import Int8LinearMethod, Int8Scheme  # noqa: E402
from splitserve.models.decoder import GatedMLP  # noqa: E402
from splitserve.models.families import decoder_spec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
# exp(100) overflows to inf on purpose (silu(-100) is -0); numpy says so in the interpreter
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture
def gen():
    g = torch.Generator(device=DEVICE)
    g.manual_seed(torch.randint(0, 2**31, ()).item())
    return g


def gate_up(M, I, dtype, gen, scale=3.0):
    x = torch.randn(M, 2 * I, generator=gen, device=DEVICE) * scale
    if M > 1:
        x[1] = 0  # an all-zero row: the eps scale, zeros
    if M > 2:
        x[2, :I] = -100.0  # exp(100) overflows fp32: silu is -0, the row is all zeros
    if M > 3:
        x[3, 0], x[3, I] = 60.0, 300.0  # one large product, the rest of the row rounds to few values
    return x.to(dtype)


def codes(q):
    return q.view(torch.uint8) if q.dtype == FP8 else q


def assert_h_close(h, ref):
    """The kernel's h vs the torch reference: exp differs by an fp32 ulp between implementations
    (GPU ex2.approx / numpy / torch's own), so a rare element of a 16-bit h is one ulp apart; fp32
    h (no rounding to absorb it) is a few fp32 ulps apart."""
    assert h.dtype == ref.dtype and h.shape == ref.shape
    if h.dtype == torch.float32:
        torch.testing.assert_close(h, ref, rtol=8 * 2**-23, atol=1e-30)
        return
    ulp = torch.finfo(h.dtype).eps
    diff = (h.float() - ref.float()).abs()
    assert (diff <= ulp * ref.float().abs()).all()
    assert (diff > 0).sum().item() <= max(1, h.numel() // 1000)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M, I", [(1, 1), (6, 301), (5, 128), (3, 4096)])
def test_silu_mul_matches_reference(M, I, dtype, gen):
    x = gate_up(M, I, dtype, gen)
    assert_h_close(A.silu_mul(x), R.silu_mul_ref(x))
    # the reference rounds once, as Inductor's silu_and_mul (x * sigmoid(x) in fp32) does; eager torch
    # rounds silu(g) to bf16 first and differs on about a quarter of the elements
    if dtype == torch.bfloat16 and M * I > 1000:
        g, u = x.float().chunk(2, -1)
        assert_h_close(R.silu_mul_ref(x), (g * torch.sigmoid(g) * u).to(dtype))
        assert (silu_and_mul(x) != R.silu_mul_ref(x)).float().mean() > 0.05


@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M, I", [(7, 301), (4, 1), (2, 2048), (2, 16385)])  # the last takes two passes
def test_fused_quantization_equals_the_quantizers(M, I, dtype, qdtype, gen):
    x = gate_up(M, I, dtype, gen)
    q, s = A.silu_mul_quant_per_token(x, qdtype)
    assert q.dtype == qdtype and q.shape == (M, I) and s.shape == (M, 1) and s.dtype == torch.float32
    h = A.silu_mul(x)
    assert_h_close(h, R.silu_mul_ref(x))
    # given the same h, bit for bit the existing quantizers (the Triton ones and the torch references)
    if qdtype == FP8:
        quantizers = (F8.quantize_fp8_per_token, R.fp8_quantize_ref)
    else:
        quantizers = (I8.quantize_int8_per_token, R.int8_quantize_ref, ops.int8_quantize_per_token)
    for quantize in quantizers:
        q_ref, s_ref = quantize(h)
        assert torch.equal(s, s_ref), quantize.__name__
        assert torch.equal(codes(q), codes(q_ref)), quantize.__name__
    # and the definition: q * s reproduces h within half a step of the format
    hf, deq = h.float(), q.float() * s
    if qdtype == FP8:
        assert ((deq - hf).abs() <= hf.abs() / 16 + s * 2**-9).all()
    else:
        assert ((deq - hf).abs() <= s * 0.5001).all()
    if M > 2:
        assert not q[1].float().any() and not q[2].float().any()


def test_bad_inputs_raise_value_errors(gen):
    x = torch.randn(4, 10, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even"):
        A.silu_mul_quant_per_token(x[:, :9], FP8)
    with pytest.raises(ValueError, match="2-D"):
        A.silu_mul(x[0])
    with pytest.raises(ValueError, match="dtype"):
        A.silu_mul_quant_per_token(x, torch.uint8)
    with pytest.raises(ValueError, match="bfloat16"):
        A.silu_mul(x.to(torch.int32))


@pytest.mark.parametrize("M", [5, 40, 100])  # the three branches: group in the GEMM, Triton GEMM, _scaled_mm
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_dispatcher_kernels_match_the_unfused_function(M, bias, gen):
    I, N = 96, 48
    x = gate_up(M, I, torch.bfloat16, gen, scale=1.0)
    w, ws = R.quantize_fp8_weight_ref(torch.randn(N, I, generator=gen, device=DEVICE) * 0.05)
    b = torch.randn(N, generator=gen, device=DEVICE, dtype=torch.bfloat16) if bias else None
    got = A.silu_mul_fp8_linear(x, w, ws.reshape(-1), b, kernels=True)
    # unfused: the reference h, then fp8_linear's reference with the activation mode it picks for M
    act = F8.fp8_small_m_act(M) if M <= F8.FP8_TRITON_MAX_M else "token"
    want = R.fp8_linear_ref(R.silu_mul_ref(x), w, ws.reshape(-1), b, act=act)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1 / 64, atol=2e-3 * want.float().abs().max().item())
    # off CUDA without kernels: exactly the references
    torch.testing.assert_close(A.silu_mul_fp8_linear(x.cpu(), w.cpu(), ws.reshape(-1).cpu(), None if b is None else b.cpu(),
                                                     kernels=False),
                               R.fp8_linear_ref(R.silu_mul_ref(x.cpu()), w.cpu(), ws.reshape(-1).cpu(),
                                                None if b is None else b.cpu(), act=act), rtol=0, atol=0)


@pytest.mark.parametrize("M", [3, 70])
def test_int8_dispatcher_kernels_match_the_unfused_function(M, gen):
    I, N = 80, 40
    x = gate_up(M, I, torch.bfloat16, gen, scale=1.0)
    w = torch.randint(-128, 128, (N, I), dtype=torch.int8, device=DEVICE, generator=gen)
    ws = torch.rand(N, generator=gen, device=DEVICE) * 1e-3
    b = torch.randn(N, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    got = A.silu_mul_int8_linear(x, w, ws, b, kernels=True)
    want = R.int8_linear_ref(R.silu_mul_ref(x), w, ws, b)  # one fp32 epilogue, one rounding
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3 * want.float().abs().max().item())
    assert torch.equal(A.silu_mul_int8_linear(x, w, ws, b, kernels=False), want)


# -- the methods and GatedMLP ------------------------------------------------------------------------
class _Only(QuantConfig):
    """Every layer gets one method (the INT8 W8A8 method without a checkpoint's config)."""

    def __init__(self, method):
        self.method = method

    def linear_method(self, names):
        return self.method


@contextlib.contextmanager
def default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def gated_mlp(quant_config, hidden=64, intermediate=96):
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=1, vocab_size=100)
    with default_dtype(torch.bfloat16):
        mlp = GatedMLP(decoder_spec(cfg), intermediate, quant_config, "model.layers.0.").to(DEVICE)
    random_quantized_weights(mlp, torch.Generator(device=DEVICE).manual_seed(0))
    # the GPU paths (the custom ops), as on an H100; on CPU the ops run the references / the interpreter
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.fp8_scaled_mm = True
        layer.int8_triton = True
    return mlp


def traced_ops(fn, *args):
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm
    out = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)(*args)
    return out, seen


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_gated_mlp_fuses_silu_into_the_down_projection(kind, gen):
    torch._dynamo.reset()
    config = Fp8Config.online() if kind == "fp8" else _Only(Int8LinearMethod("compressed-tensors",
                                                                              Int8Scheme("channel", "token")))
    mlp = gated_mlp(config)
    down = mlp.down_proj
    for M in (3, 70):
        x = torch.randn(M, 64, generator=gen, device=DEVICE, dtype=torch.bfloat16)
        with torch.inference_mode():
            got, seen = traced_ops(mlp, x)
            gu = mlp.gate_up_proj(x)
            # unfused: the activations made apart (as Inductor computes silu_and_mul), then the layer's op
            unfused = down.method.gpu_matmul(down, R.silu_mul_ref(gu))
        assert any(t.endswith(f"silu_mul_{kind}_linear.default") for t in seen)
        if kind == "fp8":
            torch.testing.assert_close(got, unfused, rtol=0, atol=0)  # both the references on CPU
        else:  # the reference int8 GEMM vs the kernel through the interpreter: one bf16 rounding apart
            torch.testing.assert_close(got, unfused, rtol=2**-7, atol=1e-3 * unfused.float().abs().max().item())
            assert torch.equal(got, R.int8_linear_ref(R.silu_mul_ref(gu), down.weight, down.weight_scale))
        # and close to the eager float computation of the same layer (the quantization's error only:
        # over 300 random inputs at most 0.043 at 3 rows, 0.019 at 70; a wrong fusion is off by O(1))
        emulated = down.method.emulated_matmul(down, silu_and_mul(gu).float()).to(torch.bfloat16)
        assert ((got.float() - emulated.float()).norm() / emulated.float().norm()).item() < 0.06


def test_gated_mlp_keeps_the_activation_for_lora_and_cpu_emulation(gen):
    from splitserve.kernels.lora.lora_add import LoRALayout
    from splitserve.lora.layers import LoRALinear, LoRAState
    torch._dynamo.reset()
    mlp = gated_mlp(Fp8Config.online())
    x = torch.randn(9, 64, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    base = mlp.down_proj
    mlp.down_proj = LoRALinear(base, ("down",), 0, LoRAState(), LoRALayout(16, 1, torch.device(DEVICE)), 1, 4)
    with torch.inference_mode():
        got, seen = traced_ops(mlp, x)
        want = base(silu_and_mul(mlp.gate_up_proj(x)))
    assert not any("silu_mul" in t for t in seen)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # CPU emulation (the method's own path off the GPU): silu_and_mul, then the emulated layer
    mlp.down_proj = base
    base.fp8_scaled_mm = False
    with torch.inference_mode():
        want = base.method.emulated_matmul(base, silu_and_mul(mlp.gate_up_proj(x))).to(torch.bfloat16)
        torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)
