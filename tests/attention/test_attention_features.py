"""Sliding windows, logit soft-capping and head dims that are not a power of two: the torch reference
against an independent dense computation (with transformers' own mask function for the window), the
Triton ragged and split-K decode kernels against the reference (TRITON_INTERPRET=1 on CPU: tiny
shapes), and the Attention layer's arguments.

Blocks that lie wholly before every query's window are pointed at a block full of NaN, as stale
table entries of blocks the KV manager freed: a kernel that read one (even masked out of the
softmax) would turn its output into NaN, so these tests also prove the loops skip those blocks.
"""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()  # before any kernel runs; see the module

from tests.attention.test_triton_attention import DEVICE, SCENARIOS, TOL, make_batch  # noqa: E402

from splitserve.attention.backend import AttentionMetadata  # noqa: E402
from splitserve.attention.layer import Attention, kv_free_window  # noqa: E402
from splitserve.attention.torch_ref import TorchRefBackend, decode_attention_batched, paged_attention_ref  # noqa: E402
from splitserve.attention.triton_backend import TritonBackend  # noqa: E402
from splitserve.kernels.attention.paged_attention import paged_decode_attention, ragged_paged_attention  # noqa: E402
from splitserve.layers.rotary import RotaryEmbedding  # noqa: E402


def poison_passed_blocks(cache, meta, window):
    """Adds a NaN block to the cache and points every table entry of a block wholly before its
    sequence's first query's window at it. Returns the new cache."""
    if window is None:
        return cache
    bs = cache.shape[2]
    nan = torch.full_like(cache[:1], float("nan"))
    cache = torch.cat([cache, nan])
    poison = cache.shape[0] - 1
    qsl = meta.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        first_key = max(0, seq_len - (qsl[i + 1] - qsl[i]) - window + 1)
        meta.block_tables[i, :first_key // bs] = poison
    return cache


def dense_oracle(q, cache, meta, scale, window, soft_cap):
    """Attention written out per sequence from a contiguous copy of its K/V, with the causal +
    sliding-window mask from transformers' masking_utils (the convention the models are checked
    against)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    bs, hkv = cache.shape[2], cache.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    qsl = meta.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        q_len = qsl[i + 1] - qsl[i]
        table = meta.block_tables[i].tolist()
        k = torch.stack([cache[table[n // bs], 0, n % bs] for n in range(seq_len)]).double()  # [L, Hkv, D]
        v = torch.stack([cache[table[n // bs], 1, n % bs] for n in range(seq_len)]).double()
        for t in range(q_len):
            p = seq_len - q_len + t
            keys = [n for n in range(seq_len) if mask_fn(0, 0, torch.tensor(p), torch.tensor(n))]
            for h in range(q.shape[1]):
                kv_h = h // (q.shape[1] // hkv)
                s = (k[keys, kv_h] @ q[qsl[i] + t, h].double()) * scale
                if soft_cap is not None:
                    s = soft_cap * torch.tanh(s / soft_cap)
                out[qsl[i] + t, h] = torch.softmax(s, 0) @ v[keys, kv_h]
    return out


# ----------------------------------------------------------------------------- the torch reference

@pytest.mark.parametrize("window,soft_cap", [(None, 5.0), (1, None), (6, None), (13, 2.0)])
def test_reference_matches_dense_oracle(window, soft_cap):
    q, cache, meta = make_batch([(30, 9), (7, 7), (21, 1), (16, 3)], num_kv_heads=2, group=2, head_dim=16,
                                dtype=torch.float32, block_size=4, seed=21)
    want = dense_oracle(q, cache, meta, 0.4, window, soft_cap)  # before the blocks are poisoned
    ref_cache = poison_passed_blocks(cache, meta, window)
    got = paged_attention_ref(q, ref_cache, meta, 0.4, sliding_window=window, soft_cap=soft_cap)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window,soft_cap", [(None, 3.0), (5, None), (9, 1.5)])
def test_reference_batched_decode_matches_loop(window, soft_cap):
    q, cache, meta = make_batch([(1, 1), (7, 1), (13, 1), (25, 1)], num_kv_heads=2, group=3, head_dim=16,
                                dtype=torch.float32, block_size=4, seed=22)
    cache = poison_passed_blocks(cache, meta, window)
    got = decode_attention_batched(q, cache, meta, 0.3, sliding_window=window, soft_cap=soft_cap)
    ref = paged_attention_ref(q, cache, meta, 0.3, sliding_window=window, soft_cap=soft_cap)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_soft_cap_changes_the_result():
    """The cap must act: with large logits capped output differs from uncapped."""
    q, cache, meta = make_batch([(12, 4)], num_kv_heads=1, group=2, head_dim=16, dtype=torch.float32, seed=23)
    q = q * 10
    assert not torch.allclose(paged_attention_ref(q, cache, meta, 0.5, soft_cap=2.0),
                              paged_attention_ref(q, cache, meta, 0.5), atol=1e-3)


# ------------------------------------------------------------------------------- ragged kernel

# Windows: one key (only itself), shorter than a KV block, straddling the 32/64-wide K/V tiles of
# the long chunk, and longer than every context (no block skipped: must equal no window).
@pytest.mark.parametrize("window", [1, 5, 40, 1000])
@pytest.mark.parametrize("scenario", ["prefix_prefill", "mixed"])
def test_ragged_sliding_window(window, scenario):
    q, cache, meta = make_batch(SCENARIOS[scenario], num_kv_heads=2, group=2, head_dim=32,
                                dtype=torch.float32, seed=window)
    cache = poison_passed_blocks(cache, meta, window)
    scale = 32 ** -0.5
    out = ragged_paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, meta.max_seq_len, scale, sliding_window=window)
    ref = paged_attention_ref(q, cache, meta, scale, sliding_window=window)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    if window == 1000:  # wider than any context: plain causal attention
        torch.testing.assert_close(out, paged_attention_ref(q, cache, meta, scale), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_soft_cap_and_window(dtype):
    q, cache, meta = make_batch(SCENARIOS["mixed"], num_kv_heads=2, group=3, head_dim=32, dtype=dtype,
                                block_size=16, seed=31)
    q = q * 4  # logits large enough that the cap matters
    cache = poison_passed_blocks(cache, meta, 20)
    out = ragged_paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, meta.max_seq_len, 0.25, sliding_window=20, soft_cap=3.0)
    ref = paged_attention_ref(q, cache, meta, 0.25, sliding_window=20, soft_cap=3.0)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_ragged_window_isolation():
    """A key just outside a query's window must not change its output; one just inside must."""
    q, cache, meta = make_batch([(20, 6)], num_kv_heads=1, group=2, head_dim=16, dtype=torch.float32,
                                block_size=4, seed=33)
    window = 5
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len, meta.max_seq_len, 0.25)
    base = ragged_paged_attention(q, cache, *args, sliding_window=window)
    # Query t sits at position 14 + t and sees positions 10 + t .. 14 + t. Change position 11:
    # visible to queries 0 and 1 (positions 14, 15), not to 2.. (16: sees 12..16).
    blk, off = int(meta.block_tables[0, 11 // 4]), 11 % 4
    cache2 = cache.clone()
    cache2[blk, :, off] += 5.0
    out2 = ragged_paged_attention(q, cache2, *args, sliding_window=window)
    assert (out2[:2] - base[:2]).abs().amax(dim=(1, 2)).min() > 1e-3
    torch.testing.assert_close(out2[2:], base[2:], atol=0, rtol=0)


# ------------------------------------------------------------------------------- decode kernel

@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,soft_cap", [(7, None), (70, 2.5), (None, 2.5)])
def test_decode_window_and_soft_cap(num_splits, window, soft_cap):
    seqs = [(150, 1), (1, 1), (33, 1), (71, 1)]
    q, cache, meta = make_batch(seqs, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32,
                                block_size=16, seed=41 + num_splits)
    q = q * 3
    cache = poison_passed_blocks(cache, meta, window)
    out = paged_decode_attention(q, cache, meta.seq_lens, meta.block_tables, meta.max_seq_len, 0.2,
                                 num_splits=num_splits, sliding_window=window, soft_cap=soft_cap)
    ref = paged_attention_ref(q, cache, meta, 0.2, sliding_window=window, soft_cap=soft_cap)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


# ---------------------------------------------------------------------- head dims not a power of two

@pytest.mark.parametrize("head_dim", [80, 96])
def test_ragged_head_dim_not_power_of_two(head_dim):
    q, cache, meta = make_batch([(37, 21), (9, 9), (16, 1)], num_kv_heads=2, group=2, head_dim=head_dim,
                                dtype=torch.float32, seed=head_dim)
    out = torch.full_like(q, 7.0)
    ragged_paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                           meta.max_query_len, meta.max_seq_len, head_dim ** -0.5, out=out)
    torch.testing.assert_close(out, paged_attention_ref(q, cache, meta, head_dim ** -0.5), **TOL[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_decode_head_dim_not_power_of_two(head_dim, num_splits):
    q, cache, meta = make_batch([(70, 1), (5, 1)], num_kv_heads=1, group=3, head_dim=head_dim,
                                dtype=torch.float32, block_size=16, seed=head_dim + num_splits)
    out = paged_decode_attention(q, cache, meta.seq_lens, meta.block_tables, meta.max_seq_len, 0.1,
                                 num_splits=num_splits)
    torch.testing.assert_close(out, paged_attention_ref(q, cache, meta, 0.1), **TOL[torch.float32])


@pytest.mark.parametrize("head_dim", [80, 96])
def test_backend_head_dim_not_power_of_two_with_rotary(head_dim):
    """The whole Triton backend (fused rotary + KV store, then attention) at head dims 80 and 96,
    against the reference backend, with a window and a soft cap."""
    num_kv_heads, group = 2, 2
    q, cache, meta = make_batch(SCENARIOS["mixed"], num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                dtype=torch.float32, seed=head_dim + 1)
    g = torch.Generator().manual_seed(head_dim)
    k = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(DEVICE)
    v = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(DEVICE)
    rotary = RotaryEmbedding(head_dim, 128, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    positions = torch.randint(0, 128, (q.shape[0],), generator=g).to(DEVICE)
    ref_cache = cache.clone()
    ref = TorchRefBackend().forward(q, k, v, ref_cache, meta, 0.1, positions, rotary.cos_sin,
                                    sliding_window=10, soft_cap=4.0)
    out = TritonBackend().forward(q, k, v, cache, meta, 0.1, positions, rotary.cos_sin, sliding_window=10, soft_cap=4.0)
    torch.testing.assert_close(cache, ref_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("head_dim,rot_dim", [(80, 32), (64, 16), (96, 48), (80, None), (64, None)])
def test_backend_partial_rotary_and_no_rotary(head_dim, rot_dim):
    """The Triton backend's fused KV store with a rotary narrower than the head (Phi-2 / StableLM /
    Persimmon shapes: only the first rot_dim features turn) and with no rotary table at all (OPT's
    learned positions), against the reference backend."""
    num_kv_heads, group = 2, 2
    q, cache, meta = make_batch(SCENARIOS["mixed"], num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                dtype=torch.float32, seed=head_dim + (rot_dim or 0))
    g = torch.Generator().manual_seed(head_dim + 7)
    k = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(DEVICE)
    v = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(DEVICE)
    cos_sin = None
    if rot_dim is not None:
        cos_sin = RotaryEmbedding(head_dim, 128, {"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": rot_dim / head_dim}).cos_sin.to(DEVICE)
        assert cos_sin.shape[-1] == rot_dim
    positions = torch.randint(0, 128, (q.shape[0],), generator=g).to(DEVICE)
    ref_cache = cache.clone()
    ref = TorchRefBackend(cpu_path=False).forward(q, k, v, ref_cache, meta, 0.1, positions, cos_sin)
    out = TritonBackend().forward(q, k, v, cache, meta, 0.1, positions, cos_sin)
    torch.testing.assert_close(cache, ref_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    if rot_dim is not None:  # the features past rot_dim are stored as they came
        stored = cache[meta.slot_mapping[0] // cache.shape[2], 0, meta.slot_mapping[0] % cache.shape[2]]
        torch.testing.assert_close(stored[:, rot_dim:], k[0, :, rot_dim:])


def test_head_dim_must_be_a_multiple_of_16():
    q, cache, meta = make_batch([(5, 5)], num_kv_heads=1, group=1, head_dim=16, dtype=torch.float32)
    q, cache = q[..., :8].contiguous(), cache[..., :8].contiguous()
    with pytest.raises(AssertionError, match="multiple of 16"):
        ragged_paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               meta.max_query_len, meta.max_seq_len, 0.1)


# ------------------------------------------------------------------------------- the layer

def test_attention_layer_arguments():
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(0, 2, 1, 16, 0.25, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        Attention(0, 2, 1, 16, 0.25, soft_cap=-1.0)
    local, full = Attention(0, 2, 1, 16, 0.25, sliding_window=8, soft_cap=50), Attention(1, 2, 1, 16, 0.25)
    assert (local.sliding_window, local.soft_cap, full.sliding_window, full.soft_cap) == (8, 50.0, None, None)
    # The KV manager may free by window only when every layer has one (then by the largest).
    assert kv_free_window(torch.nn.ModuleList([local, full])) is None
    assert kv_free_window(torch.nn.ModuleList([local, Attention(1, 2, 1, 16, 0.25, sliding_window=12)])) == 12
    assert kv_free_window(torch.nn.Linear(2, 2)) is None


def test_attention_op_passes_window_and_cap_per_layer():
    """Two layers with different windows and caps in one step, through the custom op and the forward
    context, each equal to the reference with its own settings."""
    from splitserve.attention.layer import ForwardContext, forward_context
    seqs = [(12, 12), (9, 3)]
    _, cache, meta = make_batch(seqs, num_kv_heads=1, group=2, head_dim=16, dtype=torch.float32, block_size=4,
                                seed=51)
    g = torch.Generator().manual_seed(52)
    T = 15
    qkv = [torch.randn(T, n * 16, generator=g) for n in (2, 1, 1)]
    positions = torch.cat([torch.arange(12), torch.arange(6, 9)])
    outs = []
    for layer in (Attention(0, 2, 1, 16, 0.25, sliding_window=3, soft_cap=1.5), Attention(1, 2, 1, 16, 0.25)):
        layer.kv_cache = cache.clone()
        with forward_context(ForwardContext(meta, TorchRefBackend())):
            outs.append(layer(*qkv, positions).view(T, 2, 16))
        want = paged_attention_ref(qkv[0].view(T, 2, 16), layer.kv_cache, meta, 0.25,
                                   sliding_window=layer.sliding_window, soft_cap=layer.soft_cap)
        torch.testing.assert_close(outs[-1], want)
    assert not torch.allclose(outs[0], outs[1])


# ------------------------------------------------------------------------- combined, low precision

@pytest.mark.parametrize("head_dim", [80, 96])
def test_bf16_padded_head_dim_with_window_and_soft_cap(head_dim):
    """bf16 tiles (the serving dtype) with everything at once: padded head dim, window, soft cap;
    ragged (mixed batch) and split-K decode."""
    q, cache, meta = make_batch(SCENARIOS["mixed"], num_kv_heads=2, group=2, head_dim=head_dim, dtype=torch.bfloat16,
                                block_size=16, seed=61 + head_dim)
    q = q * 3
    cache = poison_passed_blocks(cache, meta, 9)
    kw = dict(sliding_window=9, soft_cap=4.0)
    out = ragged_paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, meta.max_seq_len, 0.1, **kw)
    torch.testing.assert_close(out.float(), paged_attention_ref(q, cache, meta, 0.1, **kw).float(), **TOL[torch.bfloat16])
    q, cache, meta = make_batch([(90, 1), (20, 1)], num_kv_heads=2, group=2, head_dim=head_dim, dtype=torch.bfloat16,
                                block_size=16, seed=62 + head_dim)
    cache = poison_passed_blocks(cache, meta, 40)
    kw = dict(sliding_window=40, soft_cap=4.0)
    out = paged_decode_attention(q, cache, meta.seq_lens, meta.block_tables, meta.max_seq_len, 0.1, num_splits=2, **kw)
    torch.testing.assert_close(out.float(), paged_attention_ref(q, cache, meta, 0.1, **kw).float(), **TOL[torch.bfloat16])


def test_fp8_cache_with_window_soft_cap_and_head_dim_80():
    """An FP8 cache (scales folded into the logits before the cap) with a window and a soft cap."""
    fp8 = torch.float8_e4m3fn
    q, cache, meta = make_batch([(45, 12), (17, 1), (9, 9)], num_kv_heads=2, group=2, head_dim=80,
                                dtype=torch.float32, block_size=8, seed=71)
    ks, vs = torch.tensor([0.02]), torch.tensor([0.3])
    cache8 = torch.stack([(cache[:, 0] / ks).to(fp8), (cache[:, 1] / vs).to(fp8)], dim=1)
    kw = dict(k_scale=ks.to(DEVICE), v_scale=vs.to(DEVICE), sliding_window=10, soft_cap=2.0)
    out = ragged_paged_attention(q * 3, cache8.to(DEVICE), meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, meta.max_seq_len, 0.1, **kw)
    torch.testing.assert_close(out, paged_attention_ref(q * 3, cache8.to(DEVICE), meta, 0.1, **kw), **TOL[torch.float32])
