"""Reference attention backend: gathers each sequence's blocks and calls SDPA. The oracle for all others."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.attention.backend import FP8_E4M3_MAX, FP8_KV_DTYPE, AttentionBackend, AttentionMetadata
from splitserve.attention.torch_cpu import CPU_PATH_CACHE_DTYPES, CpuAttention
from splitserve.layers.rotary import apply_rotary


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x in the cache's dtype; for FP8: x / scale in fp32, saturated at the largest e4m3 value."""
    if dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    x = x.float() if scale is None else x.float() / scale
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def from_cache(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Cached values in fp32 (FP8 ones times their scale)."""
    return x.float() if scale is None or x.dtype != FP8_KV_DTYPE else x.float() * scale


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Writes k/v rows to their slots; rows with slot -1 (padding) are skipped."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = to_cache(k[keep], kv_cache.dtype, k_scale)
    kv_cache[blocks, 1, offsets] = to_cache(v[keep], kv_cache.dtype, v_scale)


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                   first_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's positions first_block * block_size .. seq_len - 1:
    [seq_len - first_block * block_size, num_kv_heads, head_dim] each. Blocks before first_block (those
    a sliding window has passed, whose table entries may be stale) are not read."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[block_table[first_block:num_blocks].long()]  # [nb, 2, bs, H, D]
    n = seq_len - first_block * block_size
    k = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:n]
    v = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:n]
    return k, v


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[Q, K] mask: query at position p sees key position n iff n <= p and, with a window W,
    n > p - W (W keys counting its own; transformers' sliding_window_overlay)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           soft_cap: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention in fp32 over [..., L, D] tensors; with soft_cap the scaled logits become
    soft_cap * tanh(logits / soft_cap) before the mask and softmax (Gemma 2). bias (broadcast like
    the mask) is added to the scaled logits: T5's relative position bias."""
    if bias is not None:
        if soft_cap is not None:
            raise NotImplementedError("a position bias together with a soft cap")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.float().masked_fill(~mask, float("-inf")),
                                              scale=scale)
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = soft_cap * torch.tanh(logits / soft_cap)
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1) @ v


def relative_bias(pos_bias: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[H, *q_pos.shape, K] bias of queries at q_pos over keys at k_pos from a per-head table indexed by
    the distance q - k >= 0 (`pos_bias` [H, max_len]); keys after a query (masked anyway) read entry 0."""
    d = (q_pos[..., None] - k_pos).clamp(0, pos_bias.shape[1] - 1)
    return pos_bias[:, d]


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        pos_bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros_like(q)
    num_heads, num_kv_heads, block_size = q.shape[1], kv_cache.shape[3], kv_cache.shape[2]
    qsl = meta.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        # The first block any of this sequence's queries can see.
        first_key = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        first_block = first_key // block_size
        k, v = gather_context(kv_cache, meta.block_tables[i], seq_len, first_block)
        # [H, L, D] layout; GQA by repeating KV heads.
        qi = q[start:end].transpose(0, 1).float()
        ki = from_cache(k.transpose(0, 1), k_scale).repeat_interleave(num_heads // num_kv_heads, dim=0)
        vi = from_cache(v.transpose(0, 1), v_scale).repeat_interleave(num_heads // num_kv_heads, dim=0)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(first_block * block_size, seq_len, device=q.device)
        bias = None if pos_bias is None else relative_bias(pos_bias, q_pos, k_pos)
        o = attend(qi, ki, vi, visible(q_pos, k_pos, sliding_window), scale, soft_cap, bias)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


def decode_attention_batched(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                             sliding_window: int | None = None, soft_cap: float | None = None,
                             pos_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-decode batches (one query per sequence) in one attention call over the padded contexts:
    the same maths as the per-sequence loop, without a Python loop over sequences."""
    B, num_heads, D = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    L = meta.max_seq_len
    nb = -(-L // block_size)
    # Positions each sequence's query sees: [seq_len - window, seq_len) (all of [0, seq_len) without a window).
    lo = torch.zeros_like(meta.seq_lens) if sliding_window is None else meta.seq_lens - sliding_window
    # Table entries outside those blocks are unspecified (past a sequence's end, or blocks a window has
    # passed and freed): read block 0 there (masked below).
    table = meta.block_tables[:, :nb].long()
    block_start = torch.arange(nb, device=q.device)[None, :] * block_size
    in_use = (block_start < meta.seq_lens[:, None]) & (block_start + block_size > lo[:, None])
    blocks = kv_cache[torch.where(in_use, table, 0)]  # [B, nb, 2, bs, Hkv, D]
    k = from_cache(blocks[:, :, 0].reshape(B, nb * block_size, num_kv_heads, D)[:, :L].transpose(1, 2), k_scale)
    v = from_cache(blocks[:, :, 1].reshape(B, nb * block_size, num_kv_heads, D)[:, :L].transpose(1, 2), v_scale)
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    pos = torch.arange(L, device=q.device)[None, :]
    mask = (pos < meta.seq_lens[:, None]) & (pos >= lo[:, None])
    bias = None
    if pos_bias is not None:  # [H, B, L] -> [B, H, 1, L]
        bias = relative_bias(pos_bias, meta.seq_lens.long() - 1, pos[0]).transpose(0, 1)[:, :, None, :]
    out = attend(q[:, :, None, :].float(), k, v, mask[:, None, None, :], scale, soft_cap, bias)
    return out[:, :, 0].to(q.dtype)


class TorchRefBackend(AttentionBackend):
    """Metadata and decode-graph hooks are the base class's (plain AttentionMetadata; the batched
    decode path reads only device tensors, so it runs inside a graph); nothing to precompile."""
    name = "torch_ref"

    def __init__(self, cpu_path: bool = True):
        # On CPU the same results with fewer ops (torch_cpu.py); cpu_path=False keeps the plain
        # functions below, for tests that need the oracle itself. An FP8 cache takes the plain path,
        # and so do layers with a sliding window or a soft cap (the CPU path has neither yet).
        self._cpu = CpuAttention() if cpu_path else None

    def forward(self, q, k, v, kv_cache, meta, scale, positions=None, cos_sin=None, k_scale=None, v_scale=None,
                sliding_window=None, soft_cap=None, pos_bias=None):
        if (self._cpu is not None and kv_cache.device.type == "cpu" and kv_cache.dtype in CPU_PATH_CACHE_DTYPES
                and sliding_window is None and soft_cap is None and pos_bias is None):
            return self._cpu.forward(q, k, v, kv_cache, meta, scale, positions, cos_sin)
        if cos_sin is not None:
            q, k = apply_rotary(q, positions, cos_sin), apply_rotary(k, positions, cos_sin)
        if kv_cache.dtype != FP8_KV_DTYPE:
            k_scale = v_scale = None  # only an FP8 cache is scaled
        store_kv_ref(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
        if meta.is_pure_decode and q.shape[0] == meta.num_seqs and meta.num_seqs > 1:
            return decode_attention_batched(q, kv_cache, meta, scale, k_scale, v_scale, sliding_window, soft_cap,
                                            pos_bias)
        return paged_attention_ref(q, kv_cache, meta, scale, k_scale, v_scale, sliding_window, soft_cap, pos_bias)
