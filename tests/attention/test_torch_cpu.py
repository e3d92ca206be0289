"""The reference backend's CPU path (attention/torch_cpu.py) against the plain reference functions
(torch_ref: store_kv_ref, paged_attention_ref, apply_rotary), on random steps: GQA / MQA / MHA,
ragged query and context lengths, shuffled block tables with garbage past each sequence's blocks,
padding slots."""
import pytest
import torch

from splitserve.attention.backend import AttentionMetadata
from splitserve.attention.torch_cpu import CpuAttention, attend_planned, plan_cpu_step, store_kv_planned
from splitserve.attention.torch_ref import TorchRefBackend, paged_attention_ref, store_kv_ref
from splitserve.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_qk


def random_step(seed, seqs, block_size, num_kv_heads, num_heads, head_dim, dtype=torch.float32, spare_blocks=7):
    """seqs: (context already cached, new query tokens) per sequence. Returns q, k, v, a random cache,
    the metadata and each token's position. Blocks come from a shuffled pool; table entries past a
    sequence's blocks hold an out-of-range id."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in seqs]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    pool = torch.randperm(num_blocks, generator=g).tolist()
    width = max(needed) + 2
    tables = torch.full((len(seqs), width), 10**6, dtype=torch.int32)
    slots, positions, qsl = [], [], [0]
    for i, ((ctx, n), nb) in enumerate(zip(seqs, needed)):
        ids = [pool.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(ctx, ctx + n):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    # strided views of one projection, as the model hands them over
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q, k, v = q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim), v.view(T, num_kv_heads, head_dim)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), query_start_loc=qsl_t,
                             seq_lens=lens, block_tables=tables, max_query_len=max(n for _, n in seqs),
                             max_seq_len=max(seq_lens), query_start_loc_cpu=qsl_t.clone(), seq_lens_cpu=lens.clone())
    return q, k, v, cache, meta, torch.tensor(positions, dtype=torch.long)


STEPS = {
    "decode": [(12, 1), (0, 1), (40, 1), (15, 1), (16, 1)],              # lengths on and off block edges
    "prefill": [(0, 9), (0, 3), (0, 11), (0, 7)],                        # batched, padded to 11
    "chunked": [(20, 6), (5, 8), (33, 4)],                               # queries after cached context
    "mixed": [(30, 1), (0, 12), (7, 1), (16, 5), (50, 1)],               # decode group + padded group
    "one long": [(3, 1), (0, 40), (9, 2), (2, 1), (11, 3)],              # padding would double: per sequence
    "single": [(21, 1)],
}
HEADS = [(2, 6), (3, 9), (1, 4), (4, 4)]  # (kv heads, query heads): GQA 3, the default model's, MQA, MHA


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("kv_heads,heads", HEADS)
def test_attend_matches_reference(step, kv_heads, heads):
    q, _, _, cache, meta, _ = random_step(list(STEPS).index(step) * 10 + heads, STEPS[step], 4, kv_heads, heads, 16)
    got = attend_planned(q, cache, plan_cpu_step(meta, cache, heads), 0.25)
    ref = paged_attention_ref(q, cache, meta, 0.25)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_attend_with_decode_graph_metadata():
    """A decode graph's metadata (backend hooks): lengths only in the device tensors (the host copies
    are placeholders), max_seq_len at the model's limit, a padding row of length 0. Real rows match."""
    q, _, _, cache, meta, _ = random_step(8, [(12, 1), (30, 1), (5, 1)], 4, 2, 6, 16)
    backend = TorchRefBackend()
    state = backend.decode_graph_state(8, 16, 64, 2, torch.device("cpu"))
    state.seq_lens[:6] = 50  # what a previous, longer step left
    backend.prepare_replay(state, meta, 4)
    graph_meta = backend.capture_metadata(state, 4)
    assert graph_meta.seq_lens_cpu.sum() == 0 and graph_meta.max_seq_len == 64
    q4 = torch.cat([q, torch.randn(1, 6, 16)])
    got = attend_planned(q4, cache, plan_cpu_step(graph_meta, cache, 6), 0.25)
    torch.testing.assert_close(got[:3], paged_attention_ref(q, cache, meta, 0.25), atol=1e-5, rtol=1e-5)


def test_attend_skips_sequences_without_queries():
    """A sequence scheduled with no query tokens (q_len 0) is attended by nobody; the rest are."""
    q, _, _, cache, meta, _ = random_step(3, [(5, 1), (9, 1), (4, 3)], 4, 2, 6, 16)
    meta.query_start_loc_cpu = torch.tensor([0, 1, 1, 4], dtype=torch.int32)  # the second one: none
    meta.query_start_loc = meta.query_start_loc_cpu.clone()
    q = torch.cat([q[:1], q[2:]])
    got = attend_planned(q, cache, plan_cpu_step(meta, cache, 6), 0.25)
    torch.testing.assert_close(got, paged_attention_ref(q, cache, meta, 0.25), atol=1e-5, rtol=1e-5)


def test_attend_bf16_cache():
    q, _, _, cache, meta, _ = random_step(4, STEPS["mixed"], 16, 2, 8, 64, torch.bfloat16)
    got = attend_planned(q, cache, plan_cpu_step(meta, cache, 8), 0.125)
    ref = paged_attention_ref(q, cache, meta, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding", [False, True])
def test_store_matches_reference(dtype, padding):
    _, k, v, cache, meta, _ = random_step(5, STEPS["mixed"], 4, 3, 9, 8, dtype)
    if padding:  # slot -1: not stored (first and last rows included)
        meta.slot_mapping[[0, 3, 4, -1]] = -1
    expected = cache.clone()
    store_kv_ref(k, v, expected, meta.slot_mapping)
    store_kv_planned(k, v, cache, plan_cpu_step(meta, cache, 9))
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("rot_factor", [1.0, 0.5])
def test_rotary_qk_equals_rotary_of_each(rot_factor):
    rotary = RotaryEmbedding(32, 256, {"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": rot_factor})
    q, k, _, _, _, positions = random_step(6, STEPS["chunked"], 4, 2, 6, 32)
    rq, rk = apply_rotary_qk(q, k, positions, rotary.cos_sin)
    assert torch.equal(rq, apply_rotary(q, positions, rotary.cos_sin))
    assert torch.equal(rk, apply_rotary(k, positions, rotary.cos_sin))


@pytest.mark.parametrize("step", ["decode", "mixed", "one long"])
@pytest.mark.parametrize("rot_factor", [1.0, 0.5])
def test_backend_step_matches_reference_backend(step, rot_factor):
    """A whole step through the backend's CPU path — rotary, store, attend, for two layers sharing the
    step's plan — equals the plain reference path, bit for bit in the cache."""
    head_dim = 64
    rotary = RotaryEmbedding(head_dim, 256, {"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": rot_factor})
    q, k, v, cache, meta, positions = random_step(7, STEPS[step], 16, 3, 9, head_dim)
    meta.slot_mapping[1] = -1  # a padding row
    fast, plain = TorchRefBackend(), TorchRefBackend(cpu_path=False)
    layer2 = cache.flip(0).contiguous()  # another layer's cache: same layout, other contents
    caches = [cache, layer2]
    ref_caches = [c.clone() for c in caches]
    for c, rc in zip(caches, ref_caches):
        got = fast.forward(q, k, v, c, meta, 0.125, positions, rotary.cos_sin)
        ref = plain.forward(q, k, v, rc, meta, 0.125, positions, rotary.cos_sin)
        assert torch.equal(c, rc)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_plan_is_remade_for_each_step():
    """Consecutive steps (new metadata each) on one CpuAttention: each equals the reference."""
    rotary = RotaryEmbedding(16, 256, {"rope_type": "default", "rope_theta": 10000.0})
    cpu = CpuAttention()
    for seed, step in enumerate(["prefill", "decode", "mixed", "decode"]):
        q, k, v, cache, meta, positions = random_step(20 + seed, STEPS[step], 4, 2, 6, 16)
        ref_cache = cache.clone()
        got = cpu.forward(q, k, v, cache, meta, 0.25, positions, rotary.cos_sin)
        ref = TorchRefBackend(cpu_path=False).forward(q, k, v, ref_cache, meta, 0.25, positions, rotary.cos_sin)
        assert torch.equal(cache, ref_cache)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_non_float_cache_takes_the_reference_path(monkeypatch):
    """A cache dtype the CPU path does not know (e.g. a scaled FP8 one) never reaches it."""
    monkeypatch.setattr("splitserve.attention.torch_ref.CPU_PATH_CACHE_DTYPES", (torch.bfloat16,))
    backend = TorchRefBackend()
    called = []
    monkeypatch.setattr(backend._cpu, "forward", lambda *a, **kw: called.append(1))
    q, k, v, cache, meta, _ = random_step(9, STEPS["decode"], 4, 2, 6, 16)
    backend.forward(q, k, v, cache, meta, 0.25)
    assert not called
