"""The reference backend's batched decode path equals its per-sequence loop (the oracle)."""
import torch

from splitserve.attention.backend import AttentionMetadata
from splitserve.attention.torch_ref import decode_attention_batched, paged_attention_ref


def test_batched_decode_matches_loop():
    g = torch.Generator().manual_seed(0)
    num_blocks, bs, hkv, heads, D = 40, 4, 2, 6, 16
    cache = torch.randn(num_blocks, 2, bs, hkv, D, generator=g)
    seq_lens = torch.tensor([1, 7, 13, 4], dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g).int()
    tables = perm[:4 * 5].view(4, 5).clone()  # shuffled, non-contiguous blocks
    tables[0, 1:] = 10**6  # past a sequence's blocks the table holds garbage
    meta = AttentionMetadata(slot_mapping=torch.zeros(4, dtype=torch.long),
                             query_start_loc=torch.arange(5, dtype=torch.int32), seq_lens=seq_lens,
                             block_tables=tables, max_query_len=1, max_seq_len=13,
                             query_start_loc_cpu=torch.arange(5, dtype=torch.int32), seq_lens_cpu=seq_lens)
    q = torch.randn(4, heads, D, generator=g)
    got = decode_attention_batched(q, cache, meta, 0.25)
    ref = paged_attention_ref(q, cache, meta, 0.25)
    assert torch.allclose(got, ref, atol=1e-5)
