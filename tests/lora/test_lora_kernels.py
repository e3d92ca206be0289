"""LoRA shrink/expand: the Triton kernels (lora/kernels.py, in the interpreter on CPU) and the torch
reference (lora/ops.py) against a plain per-token definition written here. Fresh random inputs each
run; odd sizes so the masks of partial tiles are exercised; tokens with no adapter in between."""
import numpy as np
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.lora import kernels  # noqa: E402
from splitserve.lora.ops import build_lora_batch, lora_add_impl, lora_expand_ref_, lora_shrink_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def gen():
    g = torch.Generator()
    g.manual_seed(torch.randint(0, 2**31, ()).item())
    return g


def token_slots(T, S, gen):
    slots = torch.randint(-1, S, (T,), generator=gen).numpy()
    slots[0] = 0  # at least one token with an adapter
    return slots


def naive_delta(x, a, b, slots, shard_sizes, R):
    """Per token, per shard: x A_i^T B_i^T in float64."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        col = 0
        for i, n in enumerate(shard_sizes):
            y = x[t].double() @ a[s, i * R:(i + 1) * R].double().t()
            out[t, col:col + n] = y @ b[s, col:col + n].double().t()
            col += n
    return out


@pytest.mark.parametrize("T,in_f,shards,R,S", [(7, 40, [24], 8, 3), (37, 72, [40, 24, 24], 16, 4),
                                               (5, 600, [33], 16, 2)])
def test_reference_matches_the_definition(T, in_f, shards, R, S, gen):
    x = torch.randn(T, in_f, generator=gen)
    a = torch.randn(S, len(shards) * R, in_f, generator=gen) * 0.1
    b = torch.randn(S, sum(shards), R, generator=gen) * 0.1
    slots = token_slots(T, S, gen)
    base = torch.randn(T, sum(shards), generator=gen)
    out = base.clone()
    lora_add_impl(out, x, a, b, shards, R, build_lora_batch(slots, "cpu"))
    torch.testing.assert_close((out - base).double(), naive_delta(x, a, b, slots, shards, R), rtol=1e-4, atol=1e-4)
    assert torch.equal(out[slots < 0], base[slots < 0])  # tokens without an adapter are untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,in_f,out_f,R,S", [(9, 48, 40, 16, 3), (70, 96, 33, 8, 5), (4, 1100, 20, 16, 2)])
def test_triton_shrink_and_expand_match_the_reference(T, in_f, out_f, R, S, dtype, gen):
    x = torch.randn(T, in_f, generator=gen).to(dtype)
    a = (torch.randn(S, R, in_f, generator=gen) * 0.1).to(dtype)
    b = (torch.randn(S, out_f, R, generator=gen) * 0.1).to(dtype)
    slots = token_slots(T, S, gen)
    batch = build_lora_batch(slots, "cpu")
    args = (batch.sorted_tokens, batch.seg_starts, batch.seg_slots, len(batch.seg_bounds), batch.max_seg_len)
    y = kernels.lora_shrink(x, a, *args)
    y_ref = lora_shrink_ref(x, a, batch)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    assert (y[torch.from_numpy(slots < 0)] == 0).all()
    base = torch.randn(T, out_f, generator=gen).to(dtype)
    out, out_ref = base.clone(), base.clone()
    kernels.lora_expand_(out, y_ref, b, *args)
    lora_expand_ref_(out_ref, y_ref, b, batch)
    torch.testing.assert_close(out.float(), out_ref.float(), **tol)
    assert torch.equal(out[torch.from_numpy(slots < 0)], base[torch.from_numpy(slots < 0)])


def test_merged_layer_through_the_kernels_matches_the_definition(gen):
    """q/k/v shards: A stacked along the rank, each shard's B writing its own (strided) columns."""
    T, in_f, shards, R, S = 21, 64, [32, 16, 16], 8, 3
    x = torch.randn(T, in_f, generator=gen)
    a = torch.randn(S, len(shards) * R, in_f, generator=gen) * 0.1
    b = torch.randn(S, sum(shards), R, generator=gen) * 0.1
    slots = token_slots(T, S, gen)
    base = torch.randn(T, sum(shards), generator=gen)
    out = base.clone()
    lora_add_impl(out, x, a, b, shards, R, build_lora_batch(slots, "cpu"), use_kernels=True)
    torch.testing.assert_close((out - base).double(), naive_delta(x, a, b, slots, shards, R), rtol=1e-4, atol=1e-4)


def test_no_adapter_in_the_step_builds_no_batch():
    assert build_lora_batch(np.full(5, -1), "cpu") is None
