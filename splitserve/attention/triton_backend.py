"""Triton attention backend: KV store + ragged paged attention (mixed batches) or split-K decode."""
from __future__ import annotations

import torch

from splitserve.attention.backend import AttentionBackend, AttentionMetadata
from splitserve.attention.ops.paged_attention import paged_decode_attention, ragged_paged_attention
from splitserve.attention.ops.store_kv import store_kv


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, decode_num_splits: int | None = None):
        # A fixed split count (e.g. set while capturing decode CUDA graphs) overrides the heuristic,
        # which otherwise depends on max_seq_len and would change the captured grid.
        self.decode_num_splits = decode_num_splits

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, positions: torch.Tensor | None = None,
                cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        rotated = store_kv(k, v, kv_cache, meta.slot_mapping, q, positions, cos_sin)  # one pass
        return self.attend(q if rotated is None else rotated, kv_cache, meta, scale)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # The decode kernel maps q row b to sequence b, which holds only when every sequence has
        # exactly one query token: T == B (both host-known shapes) together with max_query_len == 1.
        if meta.is_pure_decode and q.shape[0] == meta.num_seqs:
            return paged_decode_attention(q, kv_cache, meta.seq_lens, meta.block_tables, meta.max_seq_len,
                                          scale, num_splits=self.decode_num_splits)
        return ragged_paged_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                      meta.max_query_len, meta.max_seq_len, scale)
