"""The Triton kernels over a block-major KV pool (worker/model_runner.allocate_kv_cache for NIXL engines):
each layer is a strided view `whole[:, layer]` of one `[blocks, layers, 2, block_size, heads, dim]`
buffer. Store, ragged and split-K decode attention must give exactly what they give on a contiguous
per-layer tensor with the same contents, and a store must touch only its own layer's slice."""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.kernels.attention.paged_attention import paged_decode_attention, ragged_paged_attention  # noqa: E402
from splitserve.kernels.attention.store_kv import store_kv  # noqa: E402
from tests.attention.test_triton_attention import DEVICE, SCENARIOS, make_batch  # noqa: E402

LAYERS, LAYER = 3, 1


def block_major_copy(cache: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-major buffer whose layer LAYER holds `cache`, the other layers random; returns (whole, view)."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn((cache.shape[0], LAYERS) + tuple(cache.shape[1:]), generator=g).to(cache.dtype).to(cache.device)
    view = whole.unbind(1)[LAYER]
    view.copy_(cache)
    assert not view.is_contiguous() and view.stride(0) == LAYERS * cache[0].numel()
    return whole, view


def test_store_kv_block_major_writes_only_its_layer():
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, dim, tokens = 5, 4, 2, 64, 9
    cache = torch.randn(num_blocks, 2, block_size, heads, dim, generator=g).to(DEVICE)
    whole, view = block_major_copy(cache, seed=4)
    others = [whole[:, i].clone() for i in range(LAYERS) if i != LAYER]
    k, v = torch.randn(2, tokens, heads, dim, generator=g).to(DEVICE).unbind(0)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(DEVICE)
    store_kv(k, v, cache, slots)
    store_kv(k, v, view, slots)
    assert torch.equal(view, cache)
    assert all(torch.equal(whole[:, i], o) for i, o in zip([i for i in range(LAYERS) if i != LAYER], others))


@pytest.mark.parametrize("scenario", ["prefix_prefill", "mixed"])
def test_ragged_block_major_equals_contiguous(scenario):
    q, cache, meta = make_batch(SCENARIOS[scenario], num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32, seed=5)
    _, view = block_major_copy(cache, seed=6)
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len, meta.max_seq_len, 0.125)
    assert torch.equal(ragged_paged_attention(q, view, *args), ragged_paged_attention(q, cache, *args))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_block_major_equals_contiguous(num_splits):
    q, cache, meta = make_batch([(150, 1), (1, 1), (33, 1)], num_kv_heads=2, group=2, head_dim=64,
                                dtype=torch.float32, block_size=16, seed=num_splits)
    _, view = block_major_copy(cache, seed=7)
    args = (meta.seq_lens, meta.block_tables, meta.max_seq_len, 0.125)
    assert torch.equal(paged_decode_attention(q, view, *args, num_splits=num_splits),
                       paged_decode_attention(q, cache, *args, num_splits=num_splits))
