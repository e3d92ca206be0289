"""The Triton kernels' relative position bias (T5's decoder self-attention) and cross-attention
(encoder-decoder models) against the torch references: torch_ref's plain functions with pos_bias,
and cross_ref.cross_attention_ref. Fresh random inputs; on CPU the kernels run in the Triton
interpreter (tests/conftest.py), with the shims of tests/triton_interpreter_shims.py.
"""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()  # before any kernel runs; see the module

from tests.attention.test_triton_attention import DEVICE, TOL, make_batch  # noqa: E402

from splitserve.kernels.attention.cross_ref import (  # noqa: E402
    CrossAttentionMetadata, cross_attention_padded, cross_attention_ref, encoder_slots, store_cross_kv_ref)
from splitserve.attention.torch_ref import TorchRefBackend, paged_attention_ref  # noqa: E402
from splitserve.attention.triton_backend import TritonBackend, TritonMetadata  # noqa: E402
from splitserve.kernels.attention.cross_attention import cross_paged_attention  # noqa: E402
from splitserve.kernels.attention.paged_attention import paged_decode_attention, ragged_paged_attention  # noqa: E402

FP8 = torch.float8_e4m3fn


def bias_table(num_heads: int, max_len: int, seed: int) -> torch.Tensor:
    """A random [H, max_len] fp32 table, large enough to move the softmax (T5's are O(1..10))."""
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(num_heads, max_len, generator=g)).to(DEVICE)


# ----------------------------------------------------------------------------- relative position bias

# Contexts reach past the table (max_len 13 or 40 below): far keys share the last entry, as in T5.
BIAS_SEQS = {"prefill": [(37, 21), (19, 19), (100, 38), (70, 5)],
             "mixed": [(1, 1), (45, 12), (16, 1), (17, 1), (9, 9), (33, 1)]}


@pytest.mark.parametrize("scenario", list(BIAS_SEQS))
@pytest.mark.parametrize("dtype,kv_heads,group,head_dim,max_len", [
    (torch.float32, 2, 1, 64, 13), (torch.float32, 1, 4, 128, 40), (torch.bfloat16, 2, 3, 64, 40),
    (torch.bfloat16, 2, 2, 128, 13)])
def test_ragged_bias_matches_reference(scenario, dtype, kv_heads, group, head_dim, max_len):
    q, cache, meta = make_batch(BIAS_SEQS[scenario], num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                                dtype=dtype, block_size=16, seed=head_dim + group)
    table = bias_table(kv_heads * group, max_len, seed=group)
    scale = head_dim ** -0.5
    out = ragged_paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, meta.max_seq_len, scale, pos_bias=table)
    want = paged_attention_ref(q, cache, meta, scale, pos_bias=table)
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    # The bias matters here: without it the result differs (the test could fail).
    assert (paged_attention_ref(q, cache, meta, scale).float() - want.float()).abs().max() > 0.05


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype,kv_heads,group,head_dim", [(torch.float32, 2, 1, 128), (torch.bfloat16, 2, 4, 64)])
def test_decode_bias_matches_reference(num_splits, dtype, kv_heads, group, head_dim):
    seqs = [(150, 1), (1, 1), (33, 1), (97, 1)]
    q, cache, meta = make_batch(seqs, num_kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype,
                                block_size=16, seed=num_splits)
    table = bias_table(kv_heads * group, 50, seed=3)
    out = paged_decode_attention(q, cache, meta.seq_lens, meta.block_tables, meta.max_seq_len, 0.125,
                                 num_splits=num_splits, pos_bias=table)
    torch.testing.assert_close(out.float(), paged_attention_ref(q, cache, meta, 0.125, pos_bias=table).float(),
                               **TOL[dtype])


def test_bias_with_sliding_window():
    """A window and a bias together (no model has both yet; the kernels' masks compose): ragged and
    decode, windowed tiles skipped, against the reference."""
    q, cache, meta = make_batch(BIAS_SEQS["mixed"], num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32,
                                block_size=16, seed=21)
    table = bias_table(4, 30, seed=4)
    out = ragged_paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, meta.max_seq_len, 0.125, sliding_window=7, pos_bias=table)
    torch.testing.assert_close(out, paged_attention_ref(q, cache, meta, 0.125, sliding_window=7, pos_bias=table),
                               **TOL[torch.float32])
    q, cache, meta = make_batch([(150, 1), (33, 1)], num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32,
                                block_size=16, seed=22)
    out = paged_decode_attention(q, cache, meta.seq_lens, meta.block_tables, meta.max_seq_len, 0.125,
                                 num_splits=2, sliding_window=70, pos_bias=table)
    torch.testing.assert_close(out, paged_attention_ref(q, cache, meta, 0.125, sliding_window=70, pos_bias=table),
                               **TOL[torch.float32])


def test_bias_with_fp8_cache():
    """An FP8 cache with non-unit scales: the bias is added after k_scale joins the logits."""
    for seqs, decode in ((BIAS_SEQS["mixed"], False), ([(150, 1), (40, 1), (7, 1)], True)):
        q, cache, meta = make_batch(seqs, num_kv_heads=2, group=2, head_dim=64, dtype=torch.bfloat16,
                                    block_size=16, seed=31)
        cache8 = (cache.float() * 4).clamp(-448, 448).to(FP8)
        k_scale = torch.tensor([0.25], device=DEVICE)
        v_scale = torch.tensor([0.5], device=DEVICE)
        table = bias_table(4, 24, seed=5)
        want = paged_attention_ref(q, cache8, meta, 0.125, k_scale, v_scale, pos_bias=table)
        if decode:
            out = paged_decode_attention(q, cache8, meta.seq_lens, meta.block_tables, meta.max_seq_len, 0.125,
                                         num_splits=2, k_scale=k_scale, v_scale=v_scale, pos_bias=table)
        else:
            out = ragged_paged_attention(q, cache8, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                         meta.max_query_len, meta.max_seq_len, 0.125, k_scale=k_scale,
                                         v_scale=v_scale, pos_bias=table)
        torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])


def test_bias_refusals():
    q, cache, meta = make_batch([(9, 3)], num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32)
    args = (q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len, meta.max_seq_len,
            0.125)
    with pytest.raises(ValueError, match="soft cap"):
        ragged_paged_attention(*args, soft_cap=30.0, pos_bias=bias_table(2, 8, 0))
    with pytest.raises(ValueError, match="num_heads=2"):
        ragged_paged_attention(*args, pos_bias=bias_table(3, 8, 0))
    with pytest.raises(ValueError, match="fp32"):
        ragged_paged_attention(*args, pos_bias=bias_table(2, 8, 0).half())
    with pytest.raises(ValueError, match="soft cap"):
        TritonBackend().forward(q, q[:, :1], q[:, :1], cache, meta, 0.125, soft_cap=30.0,
                                pos_bias=bias_table(2, 8, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_forward_with_bias(dtype):
    """TritonBackend.forward with pos_bias stores K/V and attends in the kernels (mixed step, then a
    decode step through the graph hooks with a padding row), as the reference backend does."""
    for seqs, graph in ((BIAS_SEQS["mixed"], False), ([(150, 1), (9, 1), (40, 1)], True)):
        q, cache, meta = make_batch(seqs, num_kv_heads=2, group=2, head_dim=64, dtype=dtype, block_size=16, seed=41)
        g = torch.Generator().manual_seed(42)
        k = torch.randn(q.shape[0], 2, 64, generator=g).to(dtype).to(DEVICE)
        v = torch.randn(q.shape[0], 2, 64, generator=g).to(dtype).to(DEVICE)
        table = bias_table(4, 64, seed=6)
        ref_cache = cache.clone()
        want = TorchRefBackend(cpu_path=False).forward(q, k, v, ref_cache, meta, 0.125, pos_bias=table)
        backend = TritonBackend()
        if graph:
            state = backend.decode_graph_state(8, meta.block_tables.shape[1] + 2, 512, 2, torch.device(DEVICE))
            backend.prepare_replay(state, meta, 4)
            run_meta = backend.capture_metadata(state, 4)
            assert isinstance(run_meta, TritonMetadata) and run_meta.decode_num_splits > 1
            pad = torch.randn(1, *q.shape[1:], generator=g).to(dtype).to(DEVICE)
            q, k, v = torch.cat([q, pad]), torch.cat([k, pad[:, :2]]), torch.cat([v, pad[:, :2]])
        else:
            run_meta = meta
        out = backend.forward(q, k, v, cache, run_meta, 0.125, pos_bias=table)
        torch.testing.assert_close(cache.float(), ref_cache.float(), atol=0, rtol=0)
        torch.testing.assert_close(out[:want.shape[0]].float(), want.float(), **TOL[dtype])
        if graph:
            assert torch.all(out[want.shape[0]:] == 0)


# ------------------------------------------------------------------------------------ cross-attention

def cross_case(enc_lens, q_lens, kv_heads, group, head_dim, dtype, block_size=16, seed=0):
    """Encoder K/V of each sequence stored through store_cross_kv_ref in scattered blocks of a cache
    that is random elsewhere (a kernel reading past a sequence's length reads noise); block-table
    rows padded with out-of-range ids past the blocks a sequence owns (a graph's stale entries)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in enc_lens]
    num_blocks = sum(nbs) + 4
    perm = torch.randperm(num_blocks, generator=g).tolist()
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g).to(dtype)
    width = max(nbs + [1]) + 2
    table = torch.full((len(enc_lens), width), 10**6, dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(enc_lens, nbs)):
        ids = [perm.pop() for _ in range(nb)]
        table[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, kv_heads, head_dim, generator=g)
        v = torch.randn(n, kv_heads, head_dim, generator=g)
        store_cross_kv_ref(k, v, cache, torch.tensor(encoder_slots(ids, n, block_size), dtype=torch.long))
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = (1.5 * torch.randn(int(qsl[-1]), kv_heads * group, head_dim, generator=g)).to(dtype)
    lens = torch.tensor(enc_lens, dtype=torch.int32)
    meta = CrossAttentionMetadata(qsl.to(DEVICE), lens.to(DEVICE), table.to(DEVICE), max(q_lens + [1]),
                                  max(enc_lens + [1]), lens, qsl)
    return q.to(DEVICE), cache.to(DEVICE), meta


# Encoder lengths: 0 (a padding row), shorter than a block, not a multiple of the block size, across
# several 64-wide K/V tiles.
CROSS_LENS = [37, 0, 16, 5, 127, 64]


@pytest.mark.parametrize("dtype,kv_heads,group,head_dim", [
    (torch.float32, 2, 1, 64), (torch.float32, 1, 4, 128), (torch.bfloat16, 2, 3, 64),
    (torch.bfloat16, 3, 2, 128)])
@pytest.mark.parametrize("rows", ["decode", "multi_query"])
def test_cross_matches_reference(dtype, kv_heads, group, head_dim, rows):
    q_lens = [1] * len(CROSS_LENS) if rows == "decode" else [3, 2, 0, 7, 20, 1]
    q, cache, meta = cross_case(CROSS_LENS, q_lens, kv_heads, group, head_dim, dtype, seed=head_dim + group)
    scale = head_dim ** -0.5
    want = cross_attention_ref(q, cache, meta, scale)
    out = TritonBackend().cross_forward(q, cache, meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    empty = [r for i, n in enumerate(CROSS_LENS) if n == 0
             for r in range(int(meta.query_start_loc_cpu[i]), int(meta.query_start_loc_cpu[i + 1]))]
    assert torch.all(out[empty] == 0)


@pytest.mark.parametrize("num_splits", [2, 8])
def test_cross_decode_split_k(num_splits):
    """Long encoder inputs split across programs (some splits empty for the short ones)."""
    enc_lens = [577, 3, 0, 250]
    q, cache, meta = cross_case(enc_lens, [1] * 4, 2, 2, 64, torch.float32, seed=num_splits)
    out = cross_paged_attention(q, cache, meta.query_start_loc, meta.enc_lens, meta.block_tables, 1,
                                meta.max_enc_len, 0.125, num_splits=num_splits)
    torch.testing.assert_close(out, cross_attention_ref(q, cache, meta, 0.125), **TOL[torch.float32])
    assert torch.all(out[2] == 0)


def test_cross_decode_graph_layout():
    """A decode step through the graph hooks (static buffers sized for the longest encoder input,
    stale lengths and table entries from an earlier replay, one padding row) gives the eager
    reference, and the padding row is zeros; the padded torch default agrees."""
    enc_lens = [37, 100, 2]
    q, cache, meta = cross_case(enc_lens, [1] * 3, 2, 2, 64, torch.float32, seed=5)
    backend = TritonBackend()
    state = backend.cross_graph_state(8, 12, 16, torch.device(DEVICE))
    state.enc_lens.fill_(150)
    state.block_tables.fill_(10**6)
    backend.prepare_cross_replay(state, meta, padded=4)
    captured = backend.capture_cross_metadata(state, 4)
    g = torch.Generator().manual_seed(6)
    q_pad = torch.cat([q, torch.randn(1, *q.shape[1:], generator=g).to(DEVICE)])
    out = backend.cross_forward(q_pad, cache, captured, 0.125)
    torch.testing.assert_close(out[:3], cross_attention_ref(q, cache, meta, 0.125), **TOL[torch.float32])
    assert torch.all(out[3] == 0)
    torch.testing.assert_close(out, cross_attention_padded(q_pad, cache, captured, 0.125), **TOL[torch.float32])


def test_cross_fp8_cache():
    """Encoder K/V stored in an FP8 cache (cast unscaled, as store_cross_kv_ref does) read with scale 1."""
    enc_lens = [37, 0, 90]
    for q_lens in ([1, 1, 1], [2, 1, 4]):
        q, cache, meta = cross_case(enc_lens, q_lens, 2, 2, 64, torch.bfloat16, seed=7)
        cache8 = cache.float().clamp(-448, 448).to(FP8)
        out = TritonBackend().cross_forward(q, cache8, meta, 0.125)
        torch.testing.assert_close(out.float(), cross_attention_ref(q, cache8, meta, 0.125).float(),
                                   **TOL[torch.bfloat16])
