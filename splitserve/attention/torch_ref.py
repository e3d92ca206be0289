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


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first seq_len positions: [seq_len, num_kv_heads, head_dim] each."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[block_table[:num_blocks].long()]  # [nb, 2, bs, H, D]
    k = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:seq_len]
    v = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:seq_len]
    return k, v


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros_like(q)
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    qsl = meta.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k, v = gather_context(kv_cache, meta.block_tables[i], seq_len)
        # [H, L, D] layout for SDPA; GQA by repeating KV heads.
        qi = q[start:end].transpose(0, 1).float()
        ki = from_cache(k.transpose(0, 1), k_scale).repeat_interleave(num_heads // num_kv_heads, dim=0)
        vi = from_cache(v.transpose(0, 1), v_scale).repeat_interleave(num_heads // num_kv_heads, dim=0)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


def decode_attention_batched(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-decode batches (one query per sequence) in one SDPA call over the padded contexts: the
    same maths as the per-sequence loop, without a Python loop over sequences."""
    B, num_heads, D = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    L = meta.max_seq_len
    nb = -(-L // block_size)
    # Table entries past a sequence's own blocks are unspecified: read block 0 there (masked below).
    table = meta.block_tables[:, :nb].long()
    in_use = torch.arange(nb, device=q.device)[None, :] * block_size < meta.seq_lens[:, None]
    blocks = kv_cache[torch.where(in_use, table, 0)]  # [B, nb, 2, bs, Hkv, D]
    k = from_cache(blocks[:, :, 0].reshape(B, nb * block_size, num_kv_heads, D)[:, :L].transpose(1, 2), k_scale)
    v = from_cache(blocks[:, :, 1].reshape(B, nb * block_size, num_kv_heads, D)[:, :L].transpose(1, 2), v_scale)
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = torch.arange(L, device=q.device)[None, :] < meta.seq_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :].float(), k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out[:, :, 0].to(q.dtype)


class TorchRefBackend(AttentionBackend):
    """Metadata and decode-graph hooks are the base class's (plain AttentionMetadata; the batched
    decode path reads only device tensors, so it runs inside a graph); nothing to precompile."""
    name = "torch_ref"

    def __init__(self, cpu_path: bool = True):
        # On CPU the same results with fewer ops (torch_cpu.py); cpu_path=False keeps the plain
        # functions below, for tests that need the oracle itself. An FP8 cache takes the plain path.
        self._cpu = CpuAttention() if cpu_path else None

    def forward(self, q, k, v, kv_cache, meta, scale, positions=None, cos_sin=None, k_scale=None, v_scale=None):
        if self._cpu is not None and kv_cache.device.type == "cpu" and kv_cache.dtype in CPU_PATH_CACHE_DTYPES:
            return self._cpu.forward(q, k, v, kv_cache, meta, scale, positions, cos_sin)
        if cos_sin is not None:
            q, k = apply_rotary(q, positions, cos_sin), apply_rotary(k, positions, cos_sin)
        if kv_cache.dtype != FP8_KV_DTYPE:
            k_scale = v_scale = None  # only an FP8 cache is scaled
        store_kv_ref(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
        if meta.is_pure_decode and q.shape[0] == meta.num_seqs and meta.num_seqs > 1:
            return decode_attention_batched(q, kv_cache, meta, scale, k_scale, v_scale)
        return paged_attention_ref(q, kv_cache, meta, scale, k_scale, v_scale)
