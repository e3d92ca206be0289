"""Two-batch overlap's bookkeeping: cutting a step's attention metadata at a sequence boundary, and
choosing where to cut. (That the halves give the model's tokens is in
tests/models/test_scheduling_invariance.py.)"""
import random

import torch

from splitserve.attention.backend import AttentionMetadata
from splitserve.worker.overlap import balanced_split, split_metadata


def ragged_meta(q_lens: list[int], contexts: list[int], block_size: int = 4) -> AttentionMetadata:
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor([q + c for q, c in zip(q_lens, contexts)], dtype=torch.int32)
    width = -(-int(seq_lens.max()) // block_size)
    return AttentionMetadata(
        slot_mapping=torch.randint(-1, 1000, (int(qsl[-1]),)), query_start_loc=qsl.clone(), seq_lens=seq_lens.clone(),
        block_tables=torch.randint(0, 500, (len(q_lens), width), dtype=torch.int32), max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)


def test_split_metadata_is_the_two_sub_batches():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randrange(2, 12)
        q_lens = [rng.choice([1, rng.randrange(1, 40)]) for _ in range(n)]
        contexts = [rng.randrange(0, 50) for _ in range(n)]
        meta = ragged_meta(q_lens, contexts)
        j = rng.randrange(1, n)
        t = sum(q_lens[:j])
        for half, lo, hi in zip(split_metadata(meta, j), (0, j), (j, n)):
            tok_lo, tok_hi = sum(q_lens[:lo]), sum(q_lens[:hi])
            expect = ragged_meta(q_lens[lo:hi], contexts[lo:hi])
            assert half.num_seqs == hi - lo
            assert torch.equal(half.slot_mapping, meta.slot_mapping[tok_lo:tok_hi])
            assert torch.equal(half.query_start_loc, expect.query_start_loc)
            assert torch.equal(half.query_start_loc_cpu, expect.query_start_loc_cpu)
            assert torch.equal(half.seq_lens, expect.seq_lens) and torch.equal(half.seq_lens_cpu, expect.seq_lens_cpu)
            assert torch.equal(half.block_tables, meta.block_tables[lo:hi])
            assert (half.max_query_len, half.max_seq_len) == (expect.max_query_len, expect.max_seq_len)
            assert half.is_pure_decode == all(q == 1 for q in q_lens[lo:hi])
        b = split_metadata(meta, j)[1]
        # the second half's device tensors are copies (aligned), not views into the step's
        assert b.slot_mapping.data_ptr() != meta.slot_mapping[t:].data_ptr() or t == len(meta.slot_mapping)
        assert b.seq_lens.data_ptr() != meta.seq_lens[j:].data_ptr()


def test_balanced_split_picks_the_middle_sequence_boundary():
    # 360 decodes then three 1024-token prompts: 3432 tokens, the middle boundary after 360 + 1024.
    meta = ragged_meta([1] * 360 + [1024] * 3, [1000] * 360 + [0] * 3)
    j = balanced_split(meta, 512)
    assert j == 361 and int(meta.query_start_loc_cpu[j]) == 1384
    # pure decode: an even cut
    assert balanced_split(ragged_meta([1] * 600, [100] * 600), 512) == 300


def test_balanced_split_declines_small_or_lopsided_steps():
    assert balanced_split(ragged_meta([1] * 500, [10] * 500), 512) is None       # too few tokens
    assert balanced_split(ragged_meta([1] * 600, [10] * 600), 0) is None         # turned off
    assert balanced_split(ragged_meta([2048], [0]), 512) is None                  # one sequence
    assert balanced_split(ragged_meta([4000, 10, 10], [0, 5, 5]), 512) is None    # no cut near the middle
    assert balanced_split(ragged_meta([3000, 1000], [0, 0]), 512) == 1            # 3:1 is still worth it
