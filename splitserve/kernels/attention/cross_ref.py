"""Cross-attention of an encoder-decoder model: the second batchless op, in plain torch.

A request's encoder output is projected to K/V once (when its encoder runs, at its first step) and
stored in blocks of its own: the KV manager's second group, allocated from the same pool as the
decoder's self-attention blocks and laid out in the same per-layer cache tensor
([num_blocks, 2, block_size, num_kv_heads, head_dim]; the groups never share a block). Every decoder
token then attends over all of its request's encoder positions: no causal mask, one ragged length per
sequence (`enc_lens`), read through the sequence's cross block table.

Layouts: q [T, num_heads, head_dim], the step's decoder tokens in the flat stream, sequence i owning
rows query_start_loc[i]:query_start_loc[i + 1] (the self-attention metadata's split); out likewise.

`cross_attention_ref` (one sequence at a time) is the oracle; `cross_attention_padded` is the same
maths over padded tensors without a host loop or host reads (a backend's default, and what a decode
CUDA graph can capture: every shape comes from the metadata's fixed sizes). This module imports
nothing else of attention/, so backend.py can use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class CrossAttentionMetadata:
    query_start_loc: torch.Tensor   # [B+1] int32 (device): sequence i's decoder query rows
    enc_lens: torch.Tensor          # [B] int32 (device): encoder positions each sequence attends over
    block_tables: torch.Tensor      # [B, W] int32 (device): each sequence's cross blocks
    max_query_len: int              # host-known bounds of the padded layout
    max_enc_len: int
    enc_lens_cpu: torch.Tensor      # host copies, for the per-sequence reference
    query_start_loc_cpu: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.enc_lens.shape[0]


def encoder_slots(block_ids: list[int], num_tokens: int, block_size: int) -> list[int]:
    """Cache slots of encoder positions 0..num_tokens-1 in the given cross blocks."""
    return [block_ids[j // block_size] * block_size + j % block_size for j in range(num_tokens)]


def store_cross_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes encoder K/V rows ([E, Hkv, D]) to their slots ([E] int64, -1: skipped)."""
    block_size = kv_cache.shape[2]
    keep = slots >= 0
    s = slots[keep]
    kv_cache[s // block_size, 0, s % block_size] = k[keep].to(kv_cache.dtype)
    kv_cache[s // block_size, 1, s % block_size] = v[keep].to(kv_cache.dtype)


def cross_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, meta: CrossAttentionMetadata,
                        scale: float) -> torch.Tensor:
    """Each sequence's queries over its encoder K/V, one sequence at a time (the oracle)."""
    out = torch.zeros_like(q)
    num_heads, block_size, num_kv_heads = q.shape[1], kv_cache.shape[2], kv_cache.shape[3]
    qsl = meta.query_start_loc_cpu.tolist()
    for i, n in enumerate(meta.enc_lens_cpu.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end == start or n == 0:
            continue
        blocks = kv_cache[meta.block_tables[i, :-(-n // block_size)].long()]  # [nb, 2, bs, Hkv, D]
        k = blocks[:, 0].reshape(-1, num_kv_heads, q.shape[2])[:n].transpose(0, 1).float()
        v = blocks[:, 1].reshape(-1, num_kv_heads, q.shape[2])[:n].transpose(0, 1).float()
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1).float(), k, v, scale=scale)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


def cross_attention_padded(q: torch.Tensor, kv_cache: torch.Tensor, meta: CrossAttentionMetadata,
                           scale: float) -> torch.Tensor:
    """The reference's maths in one SDPA call: queries padded to max_query_len per sequence, contexts
    to max_enc_len. Reads no host copy, so it runs inside a CUDA graph (captured at fixed bounds).
    A sequence with no encoder positions (a graph's padding row) yields zeros, never NaN."""
    T, num_heads, D = q.shape
    B = meta.num_seqs
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    max_q, L = max(meta.max_query_len, 1), max(meta.max_enc_len, 1)
    nb = -(-L // block_size)
    qsl = meta.query_start_loc.long()
    # Row t belongs to sequence seq[t], at offset t - qsl[seq[t]] among its queries.
    rows = torch.arange(T, device=q.device)
    seq = torch.searchsorted(qsl[1:], rows, right=True).clamp(max=B - 1)
    pad_rows = seq * max_q + (rows - qsl[seq])
    q_pad = q.new_zeros(B * max_q, num_heads, D).index_copy_(0, pad_rows, q).view(B, max_q, num_heads, D)
    enc_lens = meta.enc_lens.long()
    table = meta.block_tables[:, :nb].long()
    in_use = torch.arange(nb, device=q.device)[None, :] * block_size < enc_lens[:, None]
    blocks = kv_cache[torch.where(in_use, table, 0)]  # [B, nb, 2, bs, Hkv, D]; unused blocks read block 0
    k = blocks[:, :, 0].reshape(B, nb * block_size, num_kv_heads, D)[:, :L].transpose(1, 2).float()
    v = blocks[:, :, 1].reshape(B, nb * block_size, num_kv_heads, D)[:, :L].transpose(1, 2).float()
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    visible = torch.arange(L, device=q.device)[None, :] < enc_lens[:, None]  # [B, L]
    o = F.scaled_dot_product_attention(q_pad.transpose(1, 2).float(), k, v,
                                       attn_mask=visible[:, None, None, :] | (enc_lens == 0)[:, None, None, None],
                                       scale=scale)  # [B, H, max_q, D]
    o = o * (enc_lens > 0)[:, None, None, None]
    return o.transpose(1, 2).reshape(B * max_q, num_heads, D)[pad_rows].to(q.dtype)
