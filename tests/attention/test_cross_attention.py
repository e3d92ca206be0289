"""Cross-attention (kernels/attention/cross_ref.py) and the relative position bias of self-attention
(torch_ref) against dense definitions written here, on fresh random inputs: ragged encoder lengths,
ragged decoder query counts, scattered cross blocks, GQA; the decode-graph layout (static buffers with
padding rows) gives the eager result."""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()  # the Triton backend's kernels run in the interpreter on CPU

from splitserve.attention.backend import AttentionBackend, AttentionMetadata  # noqa: E402
from splitserve.kernels.attention.cross_ref import (  # noqa: E402
    CrossAttentionMetadata, cross_attention_padded, cross_attention_ref, encoder_slots)
from splitserve.attention.torch_ref import TorchRefBackend  # noqa: E402

BS = 4


def _cross_case(seed, enc_lens, q_lens, heads=4, kv_heads=2, dim=8, num_blocks=64):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, 2, BS, kv_heads, dim, generator=g)  # garbage outside the stored slots
    perm = torch.randperm(num_blocks, generator=g).tolist()
    backend = AttentionBackend()
    tables, ks, vs, taken = [], [], [], 0
    for n in enc_lens:
        nb = -(-n // BS)
        ids, taken = perm[taken:taken + nb], taken + nb
        k, v = torch.randn(n, kv_heads, dim, generator=g), torch.randn(n, kv_heads, dim, generator=g)
        backend.store_cross_kv(k, v, cache, torch.tensor(encoder_slots(ids, n, BS)))
        tables.append(ids)
        ks.append(k)
        vs.append(v)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, dim, generator=g)
    meta = CrossAttentionMetadata(qsl, torch.tensor(enc_lens, dtype=torch.int32), table, max(q_lens), max(enc_lens),
                                  torch.tensor(enc_lens, dtype=torch.int32), qsl)
    return q, cache, meta, ks, vs


def _dense(q, ks, vs, q_lens, scale):
    """softmax(q k^T * scale) v per sequence, from the unpaged K/V, written out."""
    out, start = [], 0
    for k, v, n in zip(ks, vs, q_lens):
        qi = q[start:start + n]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("qhd,khd->hqk", qi, k) * scale, dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", w, v))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("seed", range(4))
def test_cross_attention_matches_dense_definition(seed):
    g = torch.Generator().manual_seed(100 + seed)
    B = int(torch.randint(1, 6, (), generator=g))
    enc_lens = torch.randint(1, 30, (B,), generator=g).tolist()
    q_lens = torch.randint(1, 6, (B,), generator=g).tolist()
    q, cache, meta, ks, vs = _cross_case(seed, enc_lens, q_lens)
    want = _dense(q, ks, vs, q_lens, 0.3)
    torch.testing.assert_close(cross_attention_ref(q, cache, meta, 0.3), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cross_attention_padded(q, cache, meta, 0.3), want, atol=1e-5, rtol=1e-5)


def test_cross_attention_decode_graph_layout():
    """A decode step through the graph hooks (static buffers sized for the longest encoder input,
    padding rows of encoder length 0) equals the eager result, and padding rows are zeros."""
    enc_lens, B = [7, 19, 2], 3
    q, cache, meta, ks, vs = _cross_case(9, enc_lens, [1] * B)
    backend = TorchRefBackend()
    state = backend.cross_graph_state(8, 10, BS, torch.device("cpu"))
    state.enc_lens.fill_(5)  # stale values of an earlier replay
    backend.prepare_cross_replay(state, meta, padded=4)
    captured = backend.capture_cross_metadata(state, 4)
    q_pad = torch.cat([q, torch.randn(1, *q.shape[1:])])
    out = backend.cross_forward(q_pad, cache, captured, 1.0)
    torch.testing.assert_close(out[:B], _dense(q, ks, vs, [1] * B, 1.0), atol=1e-5, rtol=1e-5)
    assert not out[B:].any()


@pytest.mark.parametrize("backend_name", ["torch_ref", "triton"])
def test_self_attention_position_bias_matches_dense_definition(backend_name):
    """A per-head table over query-key distance (T5's decoder bias): the ragged path and the batched
    decode path against a dense causal softmax with the bias added (the Triton backend's kernels:
    its ragged and split-K decode kernels, whose head size must be a multiple of 16)."""
    from splitserve.attention.registry import get_backend
    g = torch.Generator().manual_seed(5)
    H, D, num_blocks = 2, 16, 32
    table = torch.randn(H, 64, generator=g)
    backend = get_backend(backend_name)
    for q_lens, ctx_lens in (([3, 1, 5], [0, 6, 2]), ([1, 1, 1], [4, 9, 13])):
        cache = torch.zeros(num_blocks, 2, BS, H, D)
        seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
        perm = torch.randperm(num_blocks, generator=g).tolist()
        tables, taken, full_k, full_v = [], 0, [], []
        for L in seq_lens:
            nb = -(-L // BS)
            tables.append(perm[taken:taken + nb] + [0] * (8 - nb))
            taken += nb
            full_k.append(torch.randn(L, H, D, generator=g))
            full_v.append(torch.randn(L, H, D, generator=g))
        # context stored beforehand; the step's tokens stored by forward
        slots, qs, ks, vs = [], [], [], []
        for i, (c, L) in enumerate(zip(ctx_lens, seq_lens)):
            sl = torch.tensor(encoder_slots(tables[i], L, BS))
            AttentionBackend().store_cross_kv(full_k[i][:c], full_v[i][:c], cache, sl[:c])
            slots.append(sl[c:])
            ks.append(full_k[i][c:])
            vs.append(full_v[i][c:])
            qs.append(torch.randn(L - c, H, D, generator=g))
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        meta = AttentionMetadata(torch.cat(slots), qsl, torch.tensor(seq_lens, dtype=torch.int32),
                                 torch.tensor(tables, dtype=torch.int32), max(q_lens), max(seq_lens), qsl,
                                 torch.tensor(seq_lens, dtype=torch.int32))
        out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, 0.5, pos_bias=table)
        want = []
        for i, (c, L) in enumerate(zip(ctx_lens, seq_lens)):
            qp, kp = torch.arange(c, L), torch.arange(L)
            logits = torch.einsum("qhd,khd->hqk", qs[i], full_k[i]) * 0.5
            logits = logits + table[:, (qp[:, None] - kp[None, :]).clamp(min=0)]
            logits = logits.masked_fill(kp[None, None, :] > qp[None, :, None], float("-inf"))
            want.append(torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), full_v[i]))
        torch.testing.assert_close(out, torch.cat(want), atol=1e-5, rtol=1e-5)
