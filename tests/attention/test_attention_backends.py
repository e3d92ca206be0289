"""The attention backend interface (attention/backend.py) on CPU: the metadata builder, the full
decode-graph hooks and the start-up precompile launches, for both backends. The expected split counts
and launch lists were computed by the code these hooks replaced (the runner's per-batch-size
TritonBackend, cuda_graphs.decode_graph_metadata, kernel_precompile.attention_launches at e264f39):
the restructuring must not change a kernel, a split count or a captured graph."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from splitserve.attention.backend import AttentionKernelSpec, AttentionMetadata
from splitserve.attention.registry import get_backend
from splitserve.config import CompileConfig


def _layout():
    """A ragged step (blocks of 8): a 3-token chunk after 5 cached tokens, a decode at position 16, a
    fresh 2-token prompt."""
    return dict(
        slot_mapping=torch.tensor([37, 38, 39, 80, 8, 9]),
        query_start_loc=torch.tensor([0, 3, 4, 6], dtype=torch.int32),
        seq_lens=torch.tensor([8, 17, 2], dtype=torch.int32),
        block_tables=torch.tensor([[4, 0, 0], [9, 5, 10], [1, 0, 0]], dtype=torch.int32),
        max_query_len=3, max_seq_len=17,
        query_start_loc_cpu=torch.tensor([0, 3, 4, 6], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([8, 17, 2], dtype=torch.int32))


def _triton():
    pytest.importorskip("triton")
    from splitserve.attention import triton_backend
    return triton_backend


def test_registry():
    _triton()
    assert get_backend("torch_ref").name == "torch_ref"
    assert get_backend("triton").name == "triton" and get_backend("triton").jit_kernels
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash")


@pytest.mark.parametrize("name", ["torch_ref", "triton"])
def test_build_metadata_is_the_hand_built_metadata(name):
    if name == "triton":
        _triton()
    layout = _layout()
    meta = get_backend(name).build_metadata(**layout)
    hand = AttentionMetadata(**layout)
    assert isinstance(meta, AttentionMetadata)
    for field, value in vars(hand).items():
        assert getattr(meta, field) is value, field
    assert meta.num_seqs == 3 and not meta.is_pure_decode
    if name == "triton":  # its own metadata type; eager steps leave the split count to the heuristic
        assert type(meta) is _triton().TritonMetadata and meta.decode_num_splits is None
    else:
        assert type(meta) is AttentionMetadata


def test_torch_ref_forward_takes_its_built_metadata():
    backend = get_backend("torch_ref")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, 8, generator=g) for h in (4, 2, 2))
    cache = torch.randn(12, 2, 8, 2, 8, generator=g)
    out = backend.forward(q, k, v, cache.clone(), backend.build_metadata(**_layout()), 0.3)
    ref = backend.forward(q, k, v, cache.clone(), AttentionMetadata(**_layout()), 0.3)
    assert torch.equal(out, ref)


# The 8B shape (32 heads over 8 KV heads, 8192 positions) at 132 SMs: what the runner's per-size
# TritonBackend(default_num_splits(bs, 8, 8192)) fixed for each decode graph.
LLAMA3_8B_SPLITS = {2: 32, 4: 16, 8: 8, 16: 4, 24: 2, 32: 2, 48: 1, 64: 1, 1024: 1}


@pytest.mark.parametrize("name", ["torch_ref", "triton"])
def test_decode_graph_capture_metadata(name, monkeypatch):
    if name == "triton":
        _triton()
        from splitserve.kernels.attention import paged_attention
        monkeypatch.setattr(paged_attention, "_num_sms", lambda index: 132)  # as on an H100 SXM
    backend = get_backend(name)
    n, max_blocks = 1024, 512
    state = backend.decode_graph_state(n, max_blocks, 8192, 8, torch.device("cpu"))
    assert torch.equal(state.slot_mapping, torch.full((n,), -1)) and state.slot_mapping.dtype == torch.long
    assert torch.equal(state.seq_lens, torch.zeros(n, dtype=torch.int32))
    assert torch.equal(state.block_tables, torch.zeros(n, max_blocks, dtype=torch.int32))
    assert torch.equal(state.query_start_loc, torch.arange(n + 1, dtype=torch.int32))
    for bs in CompileConfig().decode_graph_sizes(n):
        meta = backend.capture_metadata(state, bs)
        # Views of the static buffers (their addresses are what a graph reads), one token per sequence.
        for field in ("slot_mapping", "seq_lens", "block_tables"):
            view = getattr(meta, field)
            assert view.data_ptr() == getattr(state, field).data_ptr() and view.shape[0] == bs, field
        assert meta.query_start_loc.data_ptr() == state.query_start_loc.data_ptr()
        assert meta.query_start_loc.shape == (bs + 1,) and meta.block_tables.shape == (bs, max_blocks)
        assert meta.max_query_len == 1 and meta.max_seq_len == 8192 and meta.is_pure_decode
        assert torch.equal(meta.query_start_loc_cpu, torch.arange(bs + 1, dtype=torch.int32))
        assert torch.equal(meta.seq_lens_cpu, torch.zeros(bs, dtype=torch.int32))
        if name == "triton":
            assert meta.decode_num_splits == LLAMA3_8B_SPLITS.get(bs, 1), bs
        else:
            assert type(meta) is AttentionMetadata


@pytest.mark.parametrize("name", ["torch_ref", "triton"])
def test_prepare_replay(name):
    if name == "triton":
        _triton()
    backend = get_backend(name)
    state = backend.decode_graph_state(8, 6, 96, 2, torch.device("cpu"))
    # A previous step of 5 sequences, 6 blocks wide.
    state.slot_mapping[:5] = torch.arange(100, 105)
    state.seq_lens[:5] = 90
    state.block_tables[:5] = 7
    step = AttentionMetadata(
        slot_mapping=torch.tensor([11, 40, 63]), query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=torch.tensor([12, 41, 64], dtype=torch.int32),
        block_tables=torch.tensor([[0, 0, 0, 0], [1, 2, 0, 0], [3, 4, 5, 6]], dtype=torch.int32),
        max_query_len=1, max_seq_len=64, query_start_loc_cpu=torch.arange(4, dtype=torch.int32),
        seq_lens_cpu=torch.tensor([12, 41, 64], dtype=torch.int32))
    backend.prepare_replay(state, step, 4)
    # The step's rows, then one padding row (stores nothing, attends over nothing); rows past the
    # graph's size and table columns past the step's width are not the graph's concern: left as they were.
    assert state.slot_mapping.tolist() == [11, 40, 63, -1, 104, -1, -1, -1]
    assert state.seq_lens.tolist() == [12, 41, 64, 0, 90, 0, 0, 0]
    assert torch.equal(state.block_tables[:3, :4], step.block_tables)
    assert torch.all(state.block_tables[:5, 4:] == 7) and torch.all(state.block_tables[3:5] == 7)
    assert torch.equal(state.query_start_loc, torch.arange(9, dtype=torch.int32))


# Each attention launch of the old precompile, as (tokens, sequences, max_query_len, max_seq_len,
# block-table width, decode split count or None for the ragged kernel); the decode graphs' come last.
OLD_LAUNCHES = {
    "gqa_small": (AttentionKernelSpec("triton", 8, 2, 64, torch.bfloat16, 16, 512, 4096, (), 132, 90, 64), 64, [
        (256, 256, 1, 1, 1, 1), (256, 128, 2, 2, 1, None), (256, 32, 8, 8, 1, None), (16, 1, 16, 16, 1, None),
        (2, 2, 1, 4096, 256, 16)]),
    "llama3_8b": (AttentionKernelSpec("triton", 32, 8, 128, torch.bfloat16, 16, 16384, 8192, (), 132, 90, 128), 1024, [
        (256, 256, 1, 1, 1, 1), (256, 128, 2, 2, 1, None), (256, 128, 2, 18, 2, None), (256, 32, 8, 8, 1, None),
        (256, 32, 8, 24, 2, None), (16, 1, 16, 16, 1, None), (16, 1, 16, 32, 2, None), (2, 2, 1, 8192, 512, 32)]),
    "smollm2_114_sms": (AttentionKernelSpec("triton", 9, 3, 64, torch.bfloat16, 16, 8192, 8192, (), 114, 90, 64), 256, [
        (256, 256, 1, 1, 1, 1), (256, 128, 2, 2, 1, None), (256, 32, 8, 8, 1, None), (16, 1, 16, 16, 1, None),
        (2, 2, 1, 8192, 512, 32)]),
    "tiny_budget": (AttentionKernelSpec("triton", 4, 1, 64, torch.float16, 32, 8, 2048, (), 78, 90, 0), 8, [
        (8, 8, 1, 1, 1, 1), (8, 4, 2, 2, 1, None), (8, 1, 8, 8, 1, None), (2, 2, 1, 2048, 64, 8)]),
}
# An FP8 KV cache launches the same variants, on an FP8 cache.
OLD_LAUNCHES["gqa_small_fp8_kv"] = (replace(OLD_LAUNCHES["gqa_small"][0], kv_dtype=torch.float8_e4m3fn),
                                    *OLD_LAUNCHES["gqa_small"][1:])


@pytest.mark.parametrize("case", list(OLD_LAUNCHES))
def test_precompile_launches_are_the_old_ones(case, monkeypatch):
    _triton()
    from splitserve.kernels.attention import paged_attention
    from splitserve.kernels.attention.store_kv import store_kv
    from splitserve.startup import kernel_precompile
    # The children must not ask CUDA for the SM count: the spec carries it.
    monkeypatch.setattr(paged_attention, "_num_sms", lambda index: pytest.fail("asked CUDA for the SM count"))
    spec, max_num_seqs, expected = OLD_LAUNCHES[case]
    spec = replace(spec, decode_batch_sizes=tuple(CompileConfig().decode_graph_sizes(max_num_seqs)))
    store, *attention = kernel_precompile.precompile_launches(spec, torch.device("meta"))

    n, hq, hkv, d = spec.block_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    assert store.func is store_kv
    k, v, cache, slots, q, positions, cos_sin, *scales = store.args
    kv_dtype = spec.kv_dtype or spec.dtype
    # The layer's k_scale / v_scale stand-ins: one fp32 value each, as the Attention module's buffers.
    assert [(s.shape, s.dtype) for s in scales] == [((1,), torch.float32)] * 2
    row = (hq + 2 * hkv) * d  # q, k and v are views of one projection's output
    assert (q.shape, q.stride(), k.shape, k.stride(), v.stride()) == ((n, hq, d), (row, d, 1), (n, hkv, d), (row, d, 1),
                                                                      (row, d, 1))
    assert cache.shape == (1, 2, n, hkv, d) and cache.dtype == kv_dtype and k.dtype == spec.dtype
    assert slots.dtype == positions.dtype == torch.long and slots.shape == positions.shape == (n,)
    assert (cos_sin is None) if not spec.rot_dim else (cos_sin.shape == (n, spec.rot_dim)
                                                        and cos_sin.dtype == torch.float32)

    got = []
    for launch in attention:
        q, cache, meta, scale, *scales = launch.args
        assert launch.func.__name__ == "attend" and scale == d ** -0.5
        assert [(s.shape, s.dtype) for s in scales] == [((1,), torch.float32)] * 2
        assert q.shape == (meta.slot_mapping.shape[0], hq, d) and q.is_contiguous() and q.dtype == spec.dtype
        assert cache.shape == (1, 2, spec.block_size, hkv, d) and cache.dtype == kv_dtype
        for t in (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables):
            assert t.is_contiguous() and t.device.type == "meta"
        assert meta.query_start_loc_cpu[-1] == q.shape[0] and meta.query_start_loc.shape == (meta.num_seqs + 1,)
        decode = meta.is_pure_decode and q.shape[0] == meta.num_seqs
        got.append((q.shape[0], meta.num_seqs, meta.max_query_len, meta.max_seq_len, meta.block_tables.shape[1],
                    meta.decode_num_splits if decode else None))
    assert got == expected


def test_torch_ref_has_nothing_to_precompile():
    backend = get_backend("torch_ref")
    spec = AttentionKernelSpec("torch_ref", 8, 2, 64, torch.float32, 16, 512, 4096, (2, 4), 132, 90, 64)
    assert not backend.jit_kernels and backend.precompile_launches(spec, [], torch.device("meta")) == []
    from splitserve.startup.kernel_precompile import start_attention_precompile
    # Returns before reading the config or asking CUDA anything.
    assert start_attention_precompile(None, torch.float32, 16, 512, 4096, [2, 4], backend="torch_ref") is None
