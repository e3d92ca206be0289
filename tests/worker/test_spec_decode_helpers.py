"""The worker's speculative-decoding helpers: n-gram prompt lookup and the per-row sampling data of a
verify step."""
from __future__ import annotations

import numpy as np
import torch

from splitserve.layers.sampling_metadata import PenaltyRow, SamplingMetadata
from splitserve.worker.spec_decode import NgramProposer, expand_metadata


def test_ngram_prefers_the_longest_suffix_and_the_latest_occurrence():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    # suffix [5, 6, 7] occurred at 0 (followed by 1 2 3); [6, 7] also at 9 (followed by 9 9): the longer wins
    toks = np.array([5, 6, 7, 1, 2, 3, 4, 4, 4, 6, 7, 9, 9, 5, 6, 7])
    assert p.propose(toks) == [1, 2, 3]
    # only a 1-gram matches: its latest earlier occurrence
    assert p.propose(np.array([3, 8, 1, 3, 9, 2, 3])) == [9, 2, 3]
    assert p.propose(np.array([1, 2, 3, 4])) == []
    assert NgramProposer(k=3, min_n=2, max_n=3).propose(np.array([3, 8, 1, 3, 9, 2, 3])) == []
    # fewer than k tokens follow the match
    assert p.propose(np.array([1, 2, 1])) == [2, 1]


def test_propose_many_equals_propose_row_by_row():
    rng = np.random.default_rng(0)
    for min_n, max_n in ((1, 3), (2, 4), (1, 1)):
        p = NgramProposer(k=4, min_n=min_n, max_n=max_n)
        lengths = rng.integers(1, 60, 40)
        matrix = rng.integers(0, 6, (50, 70)).astype(np.int32)  # a small alphabet: many matches
        rows = rng.permutation(50)[:40]
        got = p.propose_many(matrix, rows, lengths)
        assert got == [p.propose(matrix[r, :n]) for r, n in zip(rows, lengths)]
        assert sum(map(bool, got)) > 10


def test_expand_metadata_repeats_each_sequence_over_its_rows():
    g = torch.Generator()
    meta = SamplingMetadata(3, False, greedy=np.array([True, False, False]), temperature=np.array([0.0, 0.5, 1.0]),
                            top_k=np.array([0, 5, 0]), top_p=np.array([1.0, 0.9, 1.0]), min_p=np.zeros(3),
                            generators={1: g}, max_num_logprobs=2)
    meta.bias_rows, meta.bias_token_ids, meta.bias_values = np.array([1, 1, 2]), np.array([4, 5, 6]), \
        np.array([1.0, 2.0, 3.0], dtype=np.float32)
    meta.allowed_rows, meta.allowed_token_ids = np.array([2]), np.array([9])
    meta.penalties = [PenaltyRow(2, 1.1, 0, 0, [1], [2])]
    out = expand_metadata(meta, np.array([2, 3, 1]))
    assert out.num_rows == 6 and out.max_num_logprobs == 2
    assert out.temperature.tolist() == [0.0, 0.0, 0.5, 0.5, 0.5, 1.0]
    assert out.top_k.tolist() == [0, 0, 5, 5, 5, 0]
    assert sorted(out.generators) == [2, 3, 4] and all(x is g for x in out.generators.values())
    assert list(zip(out.bias_rows.tolist(), out.bias_token_ids.tolist())) == \
        [(2, 4), (3, 4), (4, 4), (2, 5), (3, 5), (4, 5), (5, 6)]
    assert out.bias_values.tolist() == [1, 1, 1, 2, 2, 2, 3]
    assert out.allowed_rows.tolist() == [5] and out.allowed_token_ids.tolist() == [9]
    assert out.penalties[0].row == 5
