"""LoRA shrink/expand: the Triton kernels (kernels/lora/shrink_expand.py, in the interpreter on CPU) and the torch
reference (kernels/lora/lora_add.py) against a plain per-token definition written here, on the static step layout
(lora/ops.fill_layout). Inputs have padding rows past the step's tokens, as a CUDA graph's padded
batch has: they must stay untouched. Odd sizes so the masks of partial tiles are exercised."""
import numpy as np
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.kernels.lora import shrink_expand as kernels  # noqa: E402
from splitserve.kernels.lora.lora_add import TILE, LoRALayout, fill_layout, lora_add_impl, max_tiles  # noqa: E402


@pytest.fixture
def gen():
    g = torch.Generator()
    g.manual_seed(torch.randint(0, 2**31, ()).item())
    return g


def token_slots(T, S, gen):
    slots = torch.randint(-1, S, (T,), generator=gen).numpy()
    slots[0] = S - 1  # at least one token with an adapter
    return slots


def naive_delta(x, a, b, slots, shard_sizes, R):
    """Per token, per shard: x A_i^T B_i^T in float64."""
    out = torch.zeros(len(slots), b.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        col = 0
        for i, n in enumerate(shard_sizes):
            y = x[t].double() @ a[s, i * R:(i + 1) * R].double().t()
            out[t, col:col + n] = y @ b[s, col:col + n].double().t()
            col += n
    return out


def layout_for(slots, S, max_tokens=None):
    layout = LoRALayout(max_tokens or max(len(slots), 1) + 7, S, "cpu")
    fill_layout(layout, slots)
    return layout


def run_delta(out, x, a, b, shards, R, layout, use_kernels):
    lora_add_impl(out, x, a, b, layout.num_tiles, layout.token_slots, layout.tile_slots, layout.token_rows,
                  shards, R, use_kernels=use_kernels)


def check_delta(x, a, b, shards, R, slots, use_kernels, tol, gen):
    """Delta of the step's len(slots) tokens into an output of x.shape[0] rows (the rest: padding)."""
    T = len(slots)
    base = torch.randn(x.shape[0], sum(shards), generator=gen).to(x.dtype)
    out = base.clone()
    run_delta(out, x, a, b, shards, R, layout_for(slots, a.shape[0], x.shape[0]), use_kernels)
    want = naive_delta(x[:T], a, b, slots, shards, R)
    torch.testing.assert_close((out[:T].double() - base[:T].double()), want, **tol)
    assert torch.equal(out[:T][torch.from_numpy(slots < 0)], base[:T][torch.from_numpy(slots < 0)])
    assert torch.equal(out[T:], base[T:])  # padding rows: no adapter


@pytest.mark.parametrize("T,pad,in_f,shards,R,S", [(7, 0, 40, [24], 8, 3), (37, 11, 72, [40, 24, 24], 16, 4),
                                                   (5, 3, 600, [33], 16, 2)])
def test_reference_matches_the_definition(T, pad, in_f, shards, R, S, gen):
    x = torch.randn(T + pad, in_f, generator=gen)
    a = torch.randn(S, len(shards) * R, in_f, generator=gen) * 0.1
    b = torch.randn(S, sum(shards), R, generator=gen) * 0.1
    check_delta(x, a, b, shards, R, token_slots(T, S, gen), False, dict(rtol=1e-4, atol=1e-4), gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,pad,in_f,shards,R,S", [
    (9, 7, 48, [40], 16, 3),            # one partial tile per slot, padded rows
    (70, 0, 96, [33, 20], 8, 5),        # several tiles per slot; rank 8 (padded to 16 inside)
    (4, 12, 1100, [20, 16, 16], 16, 2), # K split in parts (few tiles), three shards
    (40, 8, 64, [300], 24, 3),          # rank 24 (padded to 32), several output blocks per program
    (33, 5, 2100, [40, 16], 16, 3),     # K split in 8 parts over several tiles and two rank blocks
])
def test_triton_kernels_match_the_definition(T, pad, in_f, shards, R, S, dtype, gen):
    x = torch.randn(T + pad, in_f, generator=gen).to(dtype)
    a = (torch.randn(S, len(shards) * R, in_f, generator=gen) * 0.1).to(dtype)
    b = (torch.randn(S, sum(shards), R, generator=gen) * 0.1).to(dtype)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
    check_delta(x, a, b, shards, R, token_slots(T, S, gen), True, tol, gen)


def test_split_k_shrink_is_deterministic_and_rearms_its_counters(gen):
    """The last K part of a block sums every part in a fixed order: launches of the same inputs give
    identical bits, and each launch leaves the shared counters at zero for the next one."""
    S, T, K = 3, 40, 2100
    slots = token_slots(T, S, gen)
    layout = layout_for(slots, S, T)
    x = torch.randn(T, K, generator=gen)
    a = torch.randn(S, 32, K, generator=gen) * 0.1
    grid_tiles = max_tiles(T, S)
    args = (x, a, layout.num_tiles, layout.tile_slots, layout.token_rows, grid_tiles, TILE)
    entries = layout.token_rows[:int(layout.num_tiles) * TILE].long()
    used = torch.nonzero(entries >= 0).squeeze(1)  # entries of tokens (the rest are left unwritten)
    first = kernels.lora_shrink(*args)[0, used].clone()
    assert kernels.shrink_split(K, grid_tiles) > 1
    assert int(kernels.split_counters(x.device, 1).abs().sum()) == 0
    for _ in range(2):
        assert torch.equal(kernels.lora_shrink(*args)[0, used], first)
    rows = entries[used]
    want = torch.einsum("tk,tnk->tn", x[rows].double(), a[torch.from_numpy(slots)[rows]].double())
    torch.testing.assert_close(first.double(), want, rtol=1e-4, atol=1e-4)


def test_shrink_splits_k_less_for_many_tiles():
    assert kernels.shrink_split(1100, 1) == 2 and kernels.shrink_split(4096, 2) == 8
    assert kernels.shrink_split(14336, 2) == 16 and kernels.shrink_split(4096, 1024) == 4
    assert kernels.shrink_split(4096, 5000) == 1


def test_every_slot_with_one_token_fills_the_tile_bound(gen):
    """The grid's tile count is a bound on any layout of T tokens: 16 slots with one or two tokens
    each need exactly max_tiles(T, S) tiles, and the kernels reach every one."""
    S, T = 16, 20
    slots = np.concatenate([np.arange(S), np.arange(4)])
    assert fill_layout(LoRALayout(T, S, "cpu"), slots) == max_tiles(T, S) == 16
    x = torch.randn(T, 32, generator=gen)
    a = torch.randn(S, 8, 32, generator=gen) * 0.1
    b = torch.randn(S, 24, 8, generator=gen) * 0.1
    check_delta(x, a, b, [24], 8, slots, True, dict(rtol=1e-4, atol=1e-4), gen)


def test_empty_layout_adds_nothing_and_ignores_stale_tiles(gen):
    """num_tiles = 0 (a step without adapters, in a graph captured with the delta): stale tile
    entries past it are never read."""
    S, T = 3, 24
    layout = layout_for(np.full(T, -1), S, T)
    layout.tile_slots.fill_(1)
    layout.token_rows.fill_(0)
    x = torch.randn(T, 40, generator=gen)
    a, b = torch.randn(S, 16, 40, generator=gen), torch.randn(S, 20, 16, generator=gen)
    for use_kernels in (False, True):
        out = torch.randn(T, 20, generator=gen)
        before = out.clone()
        run_delta(out, x, a, b, [20], 16, layout, use_kernels)
        assert torch.equal(out, before)


def test_layout_groups_tokens_by_slot_in_whole_tiles():
    S, T = 5, 57
    rng = np.random.default_rng(3)
    slots = rng.integers(-1, S, T)
    layout = LoRALayout(64, S, "cpu")
    fill_layout(layout, np.full(64, 2))  # a larger step before: its tail must be cleared
    n = fill_layout(layout, slots)
    assert n == sum(-(-int((slots == s).sum()) // TILE) for s in range(S)) and n <= max_tiles(T, S)
    assert layout.num_tiles.item() == n
    assert layout.token_slots[:T].tolist() == slots.tolist() and (layout.token_slots[T:] == -1).all()
    rows = layout.token_rows[:n * TILE].view(n, TILE)
    seen = []
    for tile_slot, tile_rows in zip(layout.tile_slots[:n].tolist(), rows.tolist()):
        real = [r for r in tile_rows if r >= 0]
        assert real and all(slots[r] == tile_slot for r in real)
        assert tile_rows == real + [-1] * (TILE - len(real))  # padding only at the end of a slot's group
        seen += real
    assert sorted(seen) == np.flatnonzero(slots >= 0).tolist()  # each token with an adapter once


def test_layout_refuses_a_step_larger_than_its_buffers():
    with pytest.raises(ValueError, match="larger than the LoRA layout"):
        fill_layout(LoRALayout(8, 2, "cpu"), np.zeros(9, dtype=np.int64))
