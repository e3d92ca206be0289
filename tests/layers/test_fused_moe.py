"""The fused MoE kernels (kernels/moe/fused_moe.py) vs the torch reference (kernels/moe/reference.py).

Without CUDA the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1,
tests/triton_interpreter_shims.py fixes its bf16 dot and rounding); sizes are small and odd (H, I not
multiples of the tiles, T not a multiple of BLOCK_M) so masks, padding slots and partial tiles run.
Every check draws fresh random inputs. The reference itself is checked against a per-token loop
written straight from the formula, so the two cannot share a mistake in the sorting.
"""
import pytest
import torch
import torch.nn.functional as F

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.kernels.moe import fused_moe as FM  # noqa: E402
from splitserve.kernels.moe.reference import align_pairs_ref, fused_moe_ref  # noqa: E402
from splitserve.kernels.ops import fused_moe_op  # noqa: E402
from splitserve.layers.moe.router import topk_route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I = 48, 40
# small tiles so that the interpreter's work stays small and K / N are not multiples of them
SMALL = FM.MoeConfig(16, FM.GemmConfig(32, 32, 4, 1, 2), FM.GemmConfig(32, 32, 4, 1, 2))


@pytest.fixture
def gen():
    g = torch.Generator()
    g.manual_seed(torch.randint(0, 2**31, ()).item())
    return g


def inputs(T, E, k, dtype, gen, hidden=H, inter=I):
    x = torch.randn(T, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(E, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    weights, ids = topk_route(torch.randn(T, E, generator=gen) * 2, k, renormalize=True)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]


def naive_moe(x, w13, w2, weights, ids):
    """The formula, token by token, in fp32."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].float() @ x[t].float()
            out[t] += weights[t, j].float() * (w2[e].float() @ (F.silu(h[:inter]) * h[inter:]))
    return out


def assert_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out.float()).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    else:  # same rounding points, different fp32 summation order: at most an ulp or so apart
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


@pytest.mark.parametrize("E,k", [(8, 2), (4, 1)])
def test_reference_matches_formula(E, k, gen):
    x, w13, w2, weights, ids = inputs(19, E, k, torch.float32, gen)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), naive_moe(x, w13, w2, weights, ids),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,k", [(8, 2), (4, 1)])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_kernel_matches_reference(T, E, k, dtype, gen):
    x, w13, w2, weights, ids = inputs(T, E, k, dtype, gen)
    out = FM.fused_moe_triton(x, w13, w2, weights, ids, SMALL)
    assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), dtype)


def test_kernel_default_config_and_strided_input(gen):
    # the tile choice fused_moe makes by itself (BLOCK_K beyond K here), on a strided view of x
    x, w13, w2, weights, ids = inputs(9, 8, 2, torch.float32, gen)
    wide = torch.cat([x, torch.randn(x.shape, generator=gen).to(DEVICE)], dim=1)[:, :H]
    assert not wide.is_contiguous()
    assert_close(FM.fused_moe_triton(wide, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids),
                 torch.float32)


@pytest.mark.parametrize("rows_per_expert", [1, 64, 256, 1024])
def test_kernel_with_each_default_tile_config(rows_per_expert, gen):
    # the tiles default_config picks for decode, mid-size and prefill batches, on a small batch in
    # which most rows of each block are padding
    cfg = FM.default_config(rows_per_expert * 8, 8)
    x, w13, w2, weights, ids = inputs(21, 8, 2, torch.bfloat16, gen, hidden=40, inter=72)
    assert_close(FM.fused_moe_triton(x, w13, w2, weights, ids, cfg), fused_moe_ref(x, w13, w2, weights, ids),
                 torch.bfloat16)


def test_no_tokens(gen):
    x, w13, w2, weights, ids = inputs(0, 8, 2, torch.float32, gen)
    for fn in (fused_moe_ref, FM.fused_moe_triton):
        assert fn(x, w13, w2, weights, ids).shape == (0, H)


def test_kernel_unbalanced_routing(gen):
    # every token on experts 5 and 2 (several blocks of one expert, six experts without a token),
    # with unnormalised weights
    T, E, k = 40, 8, 2
    x, w13, w2, _, _ = inputs(T, E, k, torch.float32, gen)
    ids = torch.tensor([[5, 2]] * T, dtype=torch.int32, device=DEVICE)
    ids[::3] = torch.tensor([2, 5], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(T, k, generator=gen).to(DEVICE)
    out = FM.fused_moe_triton(x, w13, w2, weights, ids, SMALL)
    assert_close(out, naive_moe(x, w13, w2, weights, ids), torch.float32)


@pytest.mark.parametrize("align", [FM.align_pairs_by_expert, align_pairs_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("T,E,k,block_m", [(1, 8, 2, 16), (37, 8, 2, 16), (50, 4, 1, 32), (3, 60, 4, 16),
                                           (300, 8, 2, 16)])
def test_align_pairs_by_expert(T, E, k, block_m, align, gen):
    # 300 x 2 pairs span several of the Triton kernel's chunks
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    if T == 300:
        ids[100:250] = torch.tensor([3, 6][:k], dtype=torch.int32)  # long runs of one expert
    sorted_pairs, block_expert, num_padded = align(ids.to(DEVICE), E, block_m)
    sorted_pairs, block_expert, num_padded = sorted_pairs.cpu(), block_expert.cpu(), int(num_padded)
    flat = ids.reshape(-1).tolist()
    expected, experts = [], []
    for e in range(E):
        run = [p for p in range(T * k) if flat[p] == e]
        if run:
            run += [T * k] * (-len(run) % block_m)
            expected += run
            experts += [e] * (len(run) // block_m)
    assert num_padded == len(expected)
    assert len(sorted_pairs) == FM.max_padded_pairs(T * k, E, block_m) >= num_padded
    assert sorted_pairs[:num_padded].tolist() == expected
    assert (sorted_pairs[num_padded:] == T * k).all()
    assert block_expert[:num_padded // block_m].tolist() == experts


def test_op_cpu_path_and_fake():
    g = torch.Generator().manual_seed(3)
    x, w13, w2, weights, ids = inputs(6, 4, 2, torch.float32, g)
    if DEVICE == "cpu":  # the op's CPU path is the reference
        torch.testing.assert_close(fused_moe_op(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))
    torch.library.opcheck(fused_moe_op, (x, w13, w2, weights, ids),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_arguments_are_value_errors():
    g = torch.Generator().manual_seed(4)
    x, w13, w2, weights, ids = inputs(4, 4, 2, torch.float32, g)
    with pytest.raises(ValueError, match="hidden size"):
        fused_moe_ref(x[:, :-1], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_ref(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="w13"):
        fused_moe_ref(x, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="expert ids"):
        fused_moe_ref(x, w13, w2, weights, ids + 4)
    with pytest.raises(ValueError, match="top_k"):
        topk_route(torch.zeros(2, 4), 5, True)
