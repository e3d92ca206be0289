"""Triton KV-store and paged-attention kernels vs the torch reference (torch_ref.py).

On a machine without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported); shapes are tiny so the whole module runs in seconds.
"""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()  # the interpreter's bugs, see the module

from splitserve.attention.backend import AttentionMetadata  # noqa: E402
from splitserve.kernels.attention.paged_attention import (  # noqa: E402
    default_num_splits, paged_decode_attention, ragged_paged_attention)
from splitserve.attention.torch_ref import TorchRefBackend, paged_attention_ref, store_kv_ref  # noqa: E402
from splitserve.attention.triton_backend import TritonBackend, TritonMetadata  # noqa: E402
from splitserve.kernels.attention.store_kv import store_kv  # noqa: E402
from splitserve.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-4, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=2.5e-2, rtol=2e-2)}


def make_batch(seqs, num_kv_heads, group, head_dim, dtype, block_size=8, extra_blocks=5, seed=0):
    """Random batch: seqs is a list of (seq_len, q_len); queries are each context's last q_len tokens.

    Every sequence gets its blocks from a shuffled pool (non-contiguous, out-of-order block ids), and
    its block-table row is padded with out-of-range garbage past the blocks it owns. The whole cache
    is random, so prefix positions hold "cached" K/V and anything a kernel wrongly reads past
    seq_len is non-zero noise.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [(s + block_size - 1) // block_size for s, _ in seqs]
    num_blocks = sum(blocks_needed) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_needed + [1]) + 2
    block_tables = torch.full((len(seqs), max_blocks), 10**6, dtype=torch.int32)
    slots, qsl = [], [0]
    for i, ((seq_len, q_len), nb) in enumerate(zip(seqs, blocks_needed)):
        ids = [perm.pop() for _ in range(nb)]
        block_tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + q_len)
    num_tokens = qsl[-1]
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = (1.5 * torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=g)).to(dtype)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(DEVICE), query_start_loc=qsl_t.to(DEVICE),
        seq_lens=seq_lens.to(DEVICE), block_tables=block_tables.to(DEVICE),
        max_query_len=max(q for _, q in seqs), max_seq_len=max(s for s, _ in seqs),
        query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_lens)
    return q.to(DEVICE), kv_cache.to(DEVICE), meta


# ---------------------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.float16, torch.float16)])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 128)])
def test_store_kv(dtype, cache_dtype, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_tokens = 6, 4, 11
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype).to(DEVICE)
    # k, v as strided views of a fused qkv output, as the model produces them.
    qkv = torch.randn(num_tokens, 4 * num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k, v = qkv[:, 2 * num_kv_heads:3 * num_kv_heads], qkv[:, 3 * num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 4, 5, 10]] = -1  # padding rows, including first and last
    slots = slots.to(DEVICE)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    before = cache.clone()
    store_kv(k, v, cache, slots)
    if cache_dtype != dtype and DEVICE == "cpu":
        # The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even, like
        # torch): allow one bf16 ulp there, exact everywhere else.
        torch.testing.assert_close(cache, expected, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(cache, expected)
    # Slots that nobody wrote keep their old contents (padding rows were skipped).
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    untouched = (~written).view(num_blocks, block_size)
    assert torch.equal(cache.permute(0, 2, 1, 3, 4)[untouched], before.permute(0, 2, 1, 3, 4)[untouched])
    assert not torch.equal(cache, before)


# ------------------------------------------------------------------------------ ragged attention

SCENARIOS = {
    # prefill chunks whose earlier tokens are already cached (prefix hits), one chunk spanning many blocks
    # (100, 38): first query at position 62, so a query block starts just below a 32/64 tile edge.
    "prefix_prefill": [(37, 21), (19, 19), (100, 38), (70, 5)],
    # mixed: prefills, a fresh full prompt, decodes at block boundaries and mid-block
    "mixed": [(1, 1), (45, 12), (16, 1), (17, 1), (9, 9), (33, 1)],
    # decode-only batch through the ragged kernel (the path mixed batches take for their decodes)
    "decode_only": [(5, 1), (64, 1), (23, 1)],
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ragged_fp32(scenario, group, head_dim):
    q, cache, meta = make_batch(SCENARIOS[scenario], num_kv_heads=2, group=group, head_dim=head_dim,
                                dtype=torch.float32, seed=head_dim + group)
    scale = head_dim ** -0.5
    out = ragged_paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, meta.max_seq_len, scale)
    torch.testing.assert_close(out, paged_attention_ref(q, cache, meta, scale), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,head_dim", [(1, 128), (3, 64)])
def test_ragged_low_precision(dtype, group, head_dim):
    q, cache, meta = make_batch(SCENARIOS["mixed"], num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype,
                                block_size=16, seed=7)
    scale = head_dim ** -0.5
    out = ragged_paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, meta.max_seq_len, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), paged_attention_ref(q, cache, meta, scale).float(), **TOL[dtype])


def test_ragged_causality_and_isolation():
    """Changing cache entries a query may not see (future positions, other sequences' blocks) must not
    change its output; changing one it does see must."""
    q, cache, meta = make_batch([(20, 8), (12, 3)], num_kv_heads=1, group=2, head_dim=64,
                                dtype=torch.float32, block_size=4, seed=3)
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len, meta.max_seq_len, 0.125)
    base = ragged_paged_attention(q, cache, *args)
    # Position 15 of sequence 0 (its query token 3 sits at position 15; tokens 0..2 are at 12..14).
    blk, off = int(meta.block_tables[0, 15 // 4]), 15 % 4
    cache2 = cache.clone()
    cache2[blk, :, off] += 5.0
    out2 = ragged_paged_attention(q, cache2, *args)
    torch.testing.assert_close(out2[:3], base[:3], atol=0, rtol=0)       # earlier queries: unchanged
    assert (out2[3:8] - base[3:8]).abs().max() > 1e-3                     # later queries: changed
    torch.testing.assert_close(out2[8:], base[8:], atol=0, rtol=0)       # other sequence: unchanged


def test_ragged_padded_rows_not_written():
    """Rows past query_start_loc[-1] (graph padding) are not owned by any sequence: left as they were."""
    q, cache, meta = make_batch([(10, 4), (3, 1)], num_kv_heads=2, group=1, head_dim=64, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    q_pad = torch.cat([q, torch.randn(3, *q.shape[1:], generator=g).to(DEVICE)])
    out = torch.full_like(q_pad, 7.0)
    ragged_paged_attention(q_pad, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                           meta.max_query_len, meta.max_seq_len, 0.125, out=out)
    torch.testing.assert_close(out[:5], paged_attention_ref(q, cache, meta, 0.125), **TOL[torch.float32])
    assert torch.all(out[5:] == 7.0)


# ----------------------------------------------------------------------------------- split-K decode

@pytest.mark.parametrize("num_splits", [1, 3, 4])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 128)])
def test_decode_split_k_fp32(num_splits, group, head_dim):
    # Lengths chosen so some splits are empty for the short sequences and the long one spans many tiles.
    seqs = [(150, 1), (1, 1), (33, 1), (97, 1)]
    q, cache, meta = make_batch(seqs, num_kv_heads=2, group=group, head_dim=head_dim, dtype=torch.float32,
                                block_size=16, seed=num_splits)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, cache, meta.seq_lens, meta.block_tables, meta.max_seq_len, scale,
                                 num_splits=num_splits)
    torch.testing.assert_close(out, paged_attention_ref(q, cache, meta, scale), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_split_k_low_precision(dtype):
    q, cache, meta = make_batch([(130, 1), (40, 1)], num_kv_heads=2, group=3, head_dim=64, dtype=dtype, seed=11)
    scale = 0.125
    out = paged_decode_attention(q, cache, meta.seq_lens, meta.block_tables, meta.max_seq_len, scale,
                                 num_splits=4)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), paged_attention_ref(q, cache, meta, scale).float(), **TOL[dtype])


def test_decode_zero_length_padding_sequence():
    """A padded decode slot (seq_len 0, as in a captured graph batch) yields zeros, not NaN."""
    q, cache, meta = make_batch([(40, 1), (9, 1)], num_kv_heads=2, group=1, head_dim=64, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    q_pad = torch.cat([q, torch.randn(1, *q.shape[1:], generator=g).to(DEVICE)])
    seq_lens = torch.cat([meta.seq_lens, torch.zeros(1, dtype=torch.int32, device=DEVICE)])
    bt = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])])
    ref = paged_attention_ref(q, cache, meta, 0.125)
    for num_splits in (1, 2):
        out = paged_decode_attention(q_pad, cache, seq_lens, bt, 40, 0.125, num_splits=num_splits)
        torch.testing.assert_close(out[:2], ref, **TOL[torch.float32])
        assert torch.all(out[2] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,rot_dim", [(8, 2, 64, 64), (6, 3, 128, 64)])
def test_store_kv_with_rotary(dtype, num_heads, num_kv_heads, head_dim, rot_dim):
    """The fused pass: q and k rotated like layers/rotary.apply_rotary (also a partial rotary), the
    rotated k stored, padding rows skipped; q, k and v read as views of one qkv projection."""
    g = torch.Generator().manual_seed(2)
    num_blocks, block_size, num_tokens = 6, 4, 11
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    rotary = RotaryEmbedding(head_dim, 64, {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": rot_dim / head_dim}).to(DEVICE)
    positions = torch.randint(0, 64, (num_tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 5, 10]] = -1
    slots = slots.to(DEVICE)
    expected = cache.clone()
    store_kv_ref(apply_rotary(k, positions, rotary.cos_sin), v, expected, slots)
    q_rot = store_kv(k, v, cache, slots, q, positions, rotary.cos_sin)
    # fp32 rotation in both; the kernel may fuse multiply-adds, so allow an ulp of the output dtype.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(q_rot, apply_rotary(q, positions, rotary.cos_sin), **tol)
    torch.testing.assert_close(cache, expected, **tol)
    assert q_rot.is_contiguous() and q_rot.shape == q.shape


def test_default_num_splits():
    assert default_num_splits(1, 8, 32768) == 32      # long context, tiny batch: many splits
    assert default_num_splits(256, 8, 32768) == 1     # big batch already fills the GPU
    assert default_num_splits(1, 8, 100) == 1         # short context: no split
    n = default_num_splits(4, 2, 3000)
    assert n & (n - 1) == 0 and 1 <= n <= 32


# ----------------------------------------------------------------------------------------- backend

@pytest.mark.parametrize("scenario", ["mixed", "decode_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_reference(scenario, dtype):
    group, num_kv_heads, head_dim = 3, 1, 64
    q, cache, meta = make_batch(SCENARIOS[scenario], num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                dtype=dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    k = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    ref_cache = cache.clone()
    # with the model's rotary table, as the attention op calls it
    rotary = RotaryEmbedding(head_dim, 256, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    positions = torch.randint(0, 256, (q.shape[0],), generator=g).to(DEVICE)
    ref = TorchRefBackend(cpu_path=False).forward(q, k, v, ref_cache, meta, 0.125, positions, rotary.cos_sin)
    backend = TritonBackend()
    assert backend.name == "triton"
    if scenario == "decode_only":  # a fixed split count, as a captured decode graph's metadata has
        meta = TritonMetadata(**vars(meta), decode_num_splits=2)
    out = backend.forward(q, k, v, cache, meta, 0.125, positions, rotary.cos_sin)
    torch.testing.assert_close(cache, ref_cache, atol=1e-5 if dtype == torch.float32 else 0,
                               rtol=1e-5 if dtype == torch.float32 else 2 ** -7)  # same slots, same (rotated) K/V
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_decode_graph_hooks_match_reference():
    """A decode graph's attention as the backend's hooks set it up: a step of 3 sequences refilled
    (prepare_replay) into static buffers of 8 rows that hold a previous, longer step, then attended
    with the metadata of the graph of 4 (capture_metadata: views of the buffers, max_seq_len at the
    model's limit, a fixed split count). Real rows match the reference; the padding row stores
    nothing and yields zeros."""
    seqs = [(150, 1), (9, 1), (40, 1)]
    q, cache, meta = make_batch(seqs, num_kv_heads=2, group=3, head_dim=64, dtype=torch.float32, block_size=16, seed=4)
    g = torch.Generator().manual_seed(8)
    k = torch.randn(3, 2, 64, generator=g).to(DEVICE)
    v = torch.randn(3, 2, 64, generator=g).to(DEVICE)
    ref_cache = cache.clone()
    ref = TorchRefBackend(cpu_path=False).forward(q, k, v, ref_cache, meta, 0.125)
    backend = TritonBackend()
    state = backend.decode_graph_state(8, meta.block_tables.shape[1] + 3, 1024, 2, torch.device(DEVICE))
    # What a previous step of 5 sequences left there, and stale block ids past this step's table width.
    state.slot_mapping[:5] = 0
    state.seq_lens[:5] = 77
    state.block_tables.fill_(3)
    backend.prepare_replay(state, meta, 4)
    captured = backend.capture_metadata(state, 4)
    assert isinstance(captured, TritonMetadata) and captured.max_seq_len == 1024
    assert captured.decode_num_splits == default_num_splits(4, 2, 1024, torch.device(DEVICE)) > 1
    q_pad = torch.cat([q, torch.randn(1, *q.shape[1:], generator=g).to(DEVICE)])
    k_pad = torch.cat([k, torch.randn(1, 2, 64, generator=g).to(DEVICE)])
    v_pad = torch.cat([v, torch.randn(1, 2, 64, generator=g).to(DEVICE)])
    out = backend.forward(q_pad, k_pad, v_pad, cache, captured, 0.125)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)  # the same slots written, nothing for padding
    torch.testing.assert_close(out[:3], ref, **TOL[torch.float32])
    assert torch.all(out[3] == 0)
