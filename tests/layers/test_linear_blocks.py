"""layers.linear.linear: on CPU a wide weight with few rows runs in column blocks; the result is
F.linear's (checked against a float64 matmul, and against F.linear itself)."""
import pytest
import torch
import torch.nn.functional as F

import splitserve.layers.cpu_gemm as linear_mod
from splitserve.layers.cpu_gemm import linear
from splitserve.layers.linear import Linear, MergedLinear


@pytest.mark.parametrize("rows", [1, 2, 16, 128, 129])
@pytest.mark.parametrize("bias", [False, True])
def test_blocked_linear_matches_reference(monkeypatch, rows, bias):
    monkeypatch.setattr(linear_mod, "CPU_COLUMN_BLOCK", 16)  # small blocks: a ragged last one (50 = 3 * 16 + 2)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(50, 24, generator=g)
    b = torch.randn(50, generator=g) if bias else None
    x = torch.randn(rows, 24, generator=g)
    got = linear(x, w, b)
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert got.shape == (rows, 50) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-6, rtol=1e-6)


def test_blocked_linear_keeps_leading_dims_and_strided_input(monkeypatch):
    monkeypatch.setattr(linear_mod, "CPU_COLUMN_BLOCK", 8)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 12, generator=g)
    x = torch.randn(3, 4, 20, generator=g)[..., 4:16]  # [3, 4, 12], strided
    got = linear(x, w)
    assert got.shape == (3, 4, 40)
    torch.testing.assert_close(got.double(), x.double() @ w.double().t(), atol=1e-5, rtol=1e-5)


def test_real_widths_match_f_linear():
    """The default model's gate_up (3072) and LM head (49152) widths at a decode batch of 16."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 576, generator=g)
    for n in (3072, 49152):
        w = torch.randn(n, 576, generator=g) * 0.05
        torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-6, rtol=1e-6)


def test_merged_linear_uses_it(monkeypatch):
    monkeypatch.setattr(linear_mod, "CPU_COLUMN_BLOCK", 4)
    g = torch.Generator().manual_seed(2)
    layer = MergedLinear(6, {"gate": 10, "up": 10})
    layer.weight.data.copy_(torch.randn(20, 6, generator=g))
    x = torch.randn(5, 6, generator=g)
    gate, up = layer.split(layer(x))
    torch.testing.assert_close(gate.double(), x.double() @ layer.weight[:10].double().t(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(up.double(), x.double() @ layer.weight[10:].double().t(), atol=1e-6, rtol=1e-6)
    assert isinstance(layer, Linear)
