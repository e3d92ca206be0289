"""W8A8 INT8 kernels (kernels/gemm/int8/int8_gemm.py) against plain torch references.

Without CUDA the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1,
tests/triton_interpreter_shims.py fixes its bf16 rounding). The int32 accumulator is exact, so it is
compared exactly with an int64 matmul; the scaled output within one bf16/fp16 rounding of the fp32
epilogue. Shapes are small and odd (M, N, K not multiples of the tiles); every check draws fresh
random inputs.
"""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.kernels.gemm import tiles  # noqa: E402
from splitserve.kernels.gemm.int8 import int8_gemm as G  # noqa: E402
from splitserve.kernels.gemm.tiles import TileConfig  # noqa: E402
from splitserve.layers.linear import Linear  # noqa: E402
from splitserve.layers.quantization import ops  # noqa: E402
from splitserve.layers.quantization.int8 import Int8LinearMethod, Int8Scheme  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_EPS = torch.finfo(torch.float32).eps


@pytest.fixture
def gen():
    g = torch.Generator(device=DEVICE)
    g.manual_seed(torch.randint(0, 2**31, ()).item())
    return g


def rand_int8(shape, gen):
    return torch.randint(-128, 128, shape, dtype=torch.int8, device=DEVICE, generator=gen)


def exact_acc(q, w):
    return (q.long() @ w.long().t()).to(torch.int32)


def assert_one_rounding(out, q, s, w, ws, bias=None):
    """out within one rounding (to out's dtype) of (acc * s) * ws + bias computed in fp32, allowing
    a few fp32 ulps of the terms' magnitudes for FMA contraction and split-K partial sums."""
    acc = exact_acc(q, w).float()
    ref = acc * s * ws + (0 if bias is None else bias.float())
    mag = (q.long().abs() @ w.long().abs().t()).float() * s * ws + (0 if bias is None else bias.float().abs())
    tol = torch.finfo(out.dtype).eps * ref.abs() + 8 * FP32_EPS * mag
    assert torch.isfinite(out.float()).all()
    bad = (out.float() - ref).abs() > tol
    assert not bad.any(), f"{bad.sum().item()} of {bad.numel()} outputs beyond one rounding"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_matches_ops_per_token(dtype, gen):
    x = (torch.randn(7, 300, generator=gen, device=DEVICE) * 3).to(dtype)
    x[2] = 0  # an all-zero row: the eps scale, zeros
    x[4, 5] = 1e4  # one outlier: every other value of the row rounds to small integers
    q, s = G.quantize_int8_per_token(x)
    q_ref, s_ref = ops.int8_quantize_per_token(x)
    assert q.dtype == torch.int8 and s.shape == (7, 1) and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref)
    assert s[2].item() == G.SCALE_EPS and not q[2].any()


def test_quantize_long_rows_ties_and_static_scale(gen):
    x = torch.randn(3, 5000, generator=gen, device=DEVICE, dtype=torch.bfloat16)  # > one 4096 block
    q, s = G.quantize_int8_per_token(x)
    q_ref, s_ref = ops.int8_quantize_per_token(x)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)
    # exact halves round to even, as torch.round does
    static = torch.tensor([0.5], device=DEVICE)
    halves = torch.tensor([[0.25, 0.75, -0.25, -0.75, 1.25, 63.75, 100.0, -100.0]], device=DEVICE)
    q, s = G.quantize_int8_per_token(halves, static)
    assert q.tolist() == [[0, 2, 0, -2, 2, 127, 127, -128]] and s.tolist() == [0.5]
    q_ref = ops.int8_quantize(halves, static)
    assert torch.equal(q, q_ref)
    xs = torch.randn(4, 200, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    static = torch.tensor([0.01], device=DEVICE)
    assert torch.equal(G.quantize_int8_per_token(xs, static)[0], ops.int8_quantize(xs, static))


# (M, N, K): masked K tails, partial M and N tiles, several K tiles, one row
SHAPES = [(37, 72, 208), (1, 40, 96), (70, 33, 160)]
CONFIGS = {
    "pointers": TileConfig(block_m=32, block_n=32, block_k=64, num_warps=4),
    "pointers_bk128": TileConfig(block_m=16, block_n=64, block_k=128, group_m=2),
    "tma": TileConfig(block_m=32, block_n=32, block_k=32, tma=True),
    "tma_ws": TileConfig(block_m=32, block_n=32, block_k=32, num_warps=4, tma=True, warp_spec=True),
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_int32_accumulator_is_exact(shape, name, gen):
    M, N, K = shape
    q, w = rand_int8((M, K), gen), rand_int8((N, K), gen)
    q[0, :] = -128  # the extremes: -128 * -128 products summed over K
    w[0, :] = -128
    acc = G.int8_gemm(q, None, w, None, out_dtype=torch.int32, config=CONFIGS[name])
    assert acc.dtype == torch.int32 and acc.shape == (M, N)
    assert torch.equal(acc, exact_acc(q, w))


@pytest.mark.parametrize("name", list(CONFIGS) + ["split_k3", "default"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_scaled_output_with_and_without_bias(name, out_dtype, gen):
    M, N, K = 37, 72, 208
    cfg = {**CONFIGS, "split_k3": TileConfig(block_m=16, block_n=32, block_k=32, split_k=3), "default": None}[name]
    x = torch.randn(M, K, generator=gen, device=DEVICE, dtype=out_dtype)
    q, s = G.quantize_int8_per_token(x)
    w = rand_int8((N, K), gen)
    ws = torch.rand(N, generator=gen, device=DEVICE) * 1e-3 + 1e-4
    for bias in (None, torch.randn(N, generator=gen, device=DEVICE, dtype=out_dtype)):
        out = G.int8_gemm(q, s, w, ws, bias, out_dtype=out_dtype, config=cfg)
        assert out.dtype == out_dtype and out.shape == (M, N)
        assert_one_rounding(out, q, s, w, ws, bias)


def test_default_config_splits_k_for_few_tokens(gen):
    # the table's few-token rule (split-K over a wide K) against the reference, twice: the split-K
    # counters must be back at zero for the second call
    M, N, K = 3, 48, 2048
    cfg = tiles.int8_gemm_tiles(M, N, K)
    assert cfg.split_k > 1 and cfg.block_m == 16
    w = rand_int8((N, K), gen)
    ws = torch.rand(N, generator=gen, device=DEVICE) * 1e-3
    for _ in range(2):
        x = torch.randn(M, K, generator=gen, device=DEVICE, dtype=torch.bfloat16)
        q, s = G.quantize_int8_per_token(x)
        assert_one_rounding(G.int8_gemm(q, s, w, ws), q, s, w, ws)


def test_int8_linear_dynamic_static_and_leading_dims(gen):
    N, K = 40, 96
    w = rand_int8((N, K), gen)
    ws = torch.rand(N, generator=gen, device=DEVICE) * 1e-3
    bias = torch.randn(N, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(2, 5, K, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    out = G.int8_linear(x, w, ws, bias)
    assert out.shape == (2, 5, N) and out.dtype == torch.bfloat16
    q, s = ops.int8_quantize_per_token(x.reshape(10, K))
    assert_one_rounding(out.reshape(10, N), q, s, w, ws, bias)
    static = torch.tensor([0.02], device=DEVICE)
    out = G.int8_linear(x, w, ws, input_scale=static)
    assert_one_rounding(out.reshape(10, N), ops.int8_quantize(x.reshape(10, K), static), static, w, ws)


@pytest.mark.parametrize("activations", ["token", "static"])
def test_layer_gpu_matmul_matches_its_emulation(activations, gen):
    # the layer's kernel path (the custom op, here through the interpreter) against its own CPU
    # emulation: activations quantized the same way, both sides dequantized, float32 matmul
    method = Int8LinearMethod("compressed-tensors", Int8Scheme("channel", activations))
    layer = Linear(160, 72, bias=True, method=method).to(DEVICE)
    method.init_random(layer, torch.Generator(device=DEVICE).manual_seed(3))
    layer.bias.data.normal_(generator=gen)
    method.process_weights_after_loading(layer)
    x = torch.randn(9, 160, generator=gen, device=DEVICE)
    got = method.gpu_matmul(layer, x)
    layer.quant_compute_dtype = torch.float32
    want = method.emulated_matmul(layer, x)
    assert got.shape == (9, 72) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # as the engine's compiled decoder layers see it: one opaque op, any token count
    compiled = torch.compile(lambda t: method.gpu_matmul(layer, t), backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (9, 4):
        torch.testing.assert_close(compiled(x[:m]), got[:m], rtol=0, atol=0)


SYNC_TILES = [n for n, c in tiles.INT8_TILES.items() if not c.async_mma]


def test_named_tiles_are_named_by_their_fields():
    assert len(tiles.INT8_TILES) <= 10  # the device sweep compiles each once
    for name, cfg in tiles.INT8_TILES.items():
        assert cfg.name == name and cfg.tma and cfg.split_k == 1
        assert cfg.async_mma == name.startswith("async_") and cfg.warp_spec == name.startswith("tmaws_")


@pytest.mark.parametrize("name", SYNC_TILES)
def test_named_triton_tiles_are_exact(name, gen):
    # the Triton-kernel tiles run in the interpreter; the Gluon (async_*) ones cannot (Gluon has no
    # interpreter): test_async_mma_tiles_compile_for_sm90 and benchmarks/int8_gemm.py --tiles --check
    M, N, K = 150, 136, 272  # a partial M and N tile, two full K tiles and a partial one
    q, w = rand_int8((M, K), gen), rand_int8((N, K), gen)
    q[0, :] = -128
    w[0, :] = -128
    acc = G.int8_gemm(q, None, w, None, out_dtype=torch.int32, config=tiles.INT8_TILES[name])
    assert torch.equal(acc, exact_acc(q, w))


def test_table_async_tile_falls_back_without_tma(gen, monkeypatch):
    # a table entry naming the async kernel runs the pointer kernel with the same tile where TMA
    # cannot load the tensors (K % 16 != 0)
    monkeypatch.setattr(tiles, "INT8_CONFIG_TABLE", [(1 << 62, tiles.INT8_TILES["async_64x128x128_w4s4"])])
    cfg = tiles.int8_gemm_tiles(300, 72, 200)
    assert cfg.async_mma and cfg.split_k == 1
    M, N, K = 70, 72, 200
    x = torch.randn(M, K, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    q, s = G.quantize_int8_per_token(x)
    w = rand_int8((N, K), gen)
    ws = torch.rand(N, generator=gen, device=DEVICE) * 1e-3 + 1e-4
    assert not G.tma_supported(q, w)
    assert_one_rounding(G.int8_gemm(q, s, w, ws), q, s, w, ws)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU check is benchmarks/int8_gemm.py --tiles --check")
def test_async_mma_tiles_compile_for_sm90():
    # compiled for sm_90a by the stand-in driver in a fresh process (it replaces Triton's driver):
    # the Gluon kernel with and without bias, the raw int32 accumulator, a partial M tile
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "int8_gemm.py"), "--compile-only",
                          "--tiles", "async_128x128x128_w4s3", "--tiles-m", "512"],
                         capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "0 failures" in res.stdout and "STACK:0" in res.stdout
    stacks = [w for w in res.stdout.split() if w.startswith("STACK:")]
    assert stacks and all(w == "STACK:0" for w in stacks), "register spills"


def test_bad_inputs_raise_value_errors(gen):
    q, w = rand_int8((4, 64), gen), rand_int8((32, 64), gen)
    s, ws = torch.ones(4, 1, device=DEVICE), torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="K differs"):
        G.int8_gemm(q, s, w[:, :32], ws)
    with pytest.raises(ValueError, match="must be int8"):
        G.int8_gemm(q.float(), s, w, ws)
    with pytest.raises(ValueError, match="x_scale"):
        G.int8_gemm(q, torch.ones(3, device=DEVICE), w, ws)
    with pytest.raises(ValueError, match="w_scale"):
        G.int8_gemm(q, s, w, ws[:5])
    with pytest.raises(ValueError, match="bias"):
        G.int8_gemm(q, s, w, ws, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="no scales"):
        G.int8_gemm(q, s, w, ws, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="split-K"):
        G.int8_gemm(q, None, w, None, out_dtype=torch.int32,
                    config=TileConfig(block_m=16, block_n=32, block_k=16, split_k=2))
    with pytest.raises(ValueError, match="TMA kernel needs"):
        G.int8_gemm(rand_int8((4, 40), gen), s, rand_int8((32, 40), gen), ws,
                    config=TileConfig(block_m=16, block_n=32, block_k=32, tma=True))
    with pytest.raises(ValueError, match="static activation scale"):
        G.quantize_int8_per_token(torch.randn(2, 8, device=DEVICE), torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="activations"):
        G.int8_linear(torch.ones(2, 64, dtype=torch.int32, device=DEVICE), w, ws)
