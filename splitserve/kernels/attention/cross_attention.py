"""Triton cross-attention over the paged cache (encoder-decoder models), on the self-attention kernels.

Layouts are kernels/attention/cross_ref.py's: q [T, Hq, D] of the step's decoder tokens, sequence i owning
rows query_start_loc[i]:query_start_loc[i + 1]; its encoder K/V are enc_lens[i] positions read
through its cross block table, in the same [num_blocks, 2, block_size, Hkv, D] cache tensor as the
decoder's own blocks. Every query sees every encoder position: no causal mask, no window, no bias.

Cross-attention needs no kernel of its own:
  * a decode step (one query per sequence, row b is sequence b) is the split-K decode kernel with
    the encoder lengths as the context lengths: its single query "at position len - 1" sees
    positions 0 .. len - 1, which is all of them. Sequences of encoder length 0 (a decode graph's
    padding rows) yield zeros. The launch reads no host value but the host-known bounds, so a CUDA
    graph captured at the state's fixed sizes replays it for any lengths within them.
  * any other step (several queries of a sequence: a decoder prompt longer than one token, or the
    recompute after a preemption) is the ragged kernel with CAUSAL=False.
The encoder K/V are stored as the reference stores them (cross_ref.store_cross_kv_ref:
cast to the cache's dtype, unscaled), so an FP8 cache is read with scale 1.
"""
from __future__ import annotations

import torch

from splitserve.kernels.attention.paged_attention import default_num_splits, paged_decode_attention, ragged_paged_attention


def is_cross_decode(num_tokens: int, num_seqs: int, max_query_len: int) -> bool:
    """Whether a step's cross layout takes the decode kernel: one query row per sequence, in order
    (T == B together with max_query_len == 1: all host-known)."""
    return max_query_len == 1 and num_tokens == num_seqs


def cross_decode_splits(num_seqs: int, num_kv_heads: int, max_enc_len: int, device: torch.device | None = None,
                        num_sms: int | None = None) -> int:
    """The decode kernel's split count for a cross step: from host-known bounds only (the batch and
    the longest encoder input the layout allows), so a graph's capture and the start-up precompile
    pick the same count."""
    return default_num_splits(num_seqs, num_kv_heads, max_enc_len, device, num_sms=num_sms)


def cross_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                          enc_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, max_enc_len: int,
                          scale: float, num_splits: int | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Each decoder query over its sequence's encoder K/V; returns [T, Hq, D] (rows not owned by any
    sequence are left unwritten). query_start_loc [B+1], enc_lens [B] and block_tables [B, W] are
    int32 device tensors; max_query_len / max_enc_len host bounds. num_splits: the decode kernel's
    split count (None: cross_decode_splits)."""
    num_seqs = enc_lens.shape[0]
    if is_cross_decode(q.shape[0], num_seqs, max_query_len):
        if num_splits is None:
            num_splits = cross_decode_splits(num_seqs, kv_cache.shape[3], max_enc_len, q.device)
        return paged_decode_attention(q, kv_cache, enc_lens, block_tables, max(max_enc_len, 1), scale,
                                      num_splits=num_splits, out=out)
    return ragged_paged_attention(q, kv_cache, query_start_loc, enc_lens, block_tables, max(max_query_len, 1),
                                  max(max_enc_len, 1), scale, out=out, causal=False)
