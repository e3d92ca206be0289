"""The reference backend's CPU path: torch_ref's results (the oracle) with fewer, cheaper ops.

On CPU the reference backend is the serving path, and every op is paid for eagerly: a few
microseconds of dispatch each, and with several threads an OpenMP fork/join each, 30 layers a step.
So what every layer of a step derives alike from the step's metadata — the rows the K/V stores go
to, the gather indices of the context blocks, the masks, the rotary factors at the step's positions,
the gather buffers — is computed once, at the step's first layer (`plan_cpu_step`), and each layer
then runs a handful of ops:

- rotary of q and k in one pass (`rotate_qk_planned`);
- the K/V store as two `index_copy_` into the cache seen as rows of one token's K (or V): an
  advanced-index assignment through [blocks, 0, offsets] costs milliseconds on a large cache, an
  index_copy_ costs what it writes (`store_kv_planned`);
- attention in one SDPA call per group of sequences (`attend_planned`): each sequence's context is
  gathered block by block with one index_select straight into [B, blocks * block_size, Hkv, D] (no
  gather of K/V pairs then a copy of each half), and GQA needs no repeat_interleave of K and V: the
  `group` query heads sharing a KV head become that head's `group * max_q` query rows. Decode
  sequences (one query each) form one group; sequences with longer queries form another, padded to
  the longest, unless padding would more than double its rows (then one group per sequence).

Every function here has a test against torch_ref's (tests/attention/test_torch_cpu.py). This module
imports nothing of torch_ref, which dispatches to it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve.attention.backend import AttentionMetadata
from splitserve.layers.rotary import apply_rotary_qk

# Cache dtypes the CPU path stores and reads as they are (a cache of another dtype, e.g. a scaled
# FP8 one, goes through the reference functions).
CPU_PATH_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class AttentionGroup:
    """Sequences attended in one SDPA call, their queries padded to max_q rows each."""
    rows: torch.Tensor | None       # [Tg] the group's query rows in the step (None: all rows, in order)
    pad_rows: torch.Tensor | None   # [Tg] each of them in the padded [num_seqs * max_q] layout (None: max_q == 1)
    num_seqs: int
    max_q: int
    halves: torch.Tensor            # [num_seqs * nb] each context block's K in the cache seen as
                                    # [num_blocks * 2, block_size, Hkv, D] (its V: + 1)
    mask: torch.Tensor              # [num_seqs, 1, rows per KV head, nb * block_size]: may attend
    k_buf: torch.Tensor             # [num_seqs * nb, block_size, Hkv, D] gather buffers, reused by every layer
    v_buf: torch.Tensor


@dataclass
class CpuStepPlan:
    meta: AttentionMetadata
    positions: torch.Tensor | None
    cos_sin: torch.Tensor | None
    cache_layout: tuple                  # the KV cache's (shape[1:], dtype) the indices were made for
    num_heads: int
    store_rows: torch.Tensor             # [T'] row of each stored token's K in the cache seen as
                                         # [num_blocks * 2 * block_size, Hkv * D]; its V is block_size further
    store_keep: torch.Tensor | None      # [T'] token rows that store (None: all; slot -1 rows do not)
    rot_cos: torch.Tensor | None         # [T, 1, D]: cos | cos at each token's position (full-width rotary)
    rot_sin: torch.Tensor | None         # [T, 1, D]: -sin | sin
    groups: list[AttentionGroup]
    meta_tensors: tuple = field(init=False)  # the metadata's tensors the plan was made from

    def __post_init__(self):
        self.meta_tensors = (self.meta.slot_mapping, self.meta.block_tables, self.meta.seq_lens)

    def fits(self, meta, positions, cos_sin, kv_cache, num_heads) -> bool:
        """Made for this step: the same metadata (and its tensors), positions, table and cache layout.
        (The plan holds them, so a match by identity cannot be a recycled object.)"""
        return (meta is self.meta and positions is self.positions and cos_sin is self.cos_sin
                and meta.slot_mapping is self.meta_tensors[0] and meta.block_tables is self.meta_tensors[1]
                and meta.seq_lens is self.meta_tensors[2] and num_heads == self.num_heads
                and (kv_cache.shape[1:], kv_cache.dtype) == self.cache_layout)


def _context_blocks(table: torch.Tensor, lens: torch.Tensor, nb: int, block_size: int) -> torch.Tensor:
    """AttentionGroup.halves of sequences with these block-table rows and context lengths."""
    # Table entries past a sequence's own blocks are unspecified: read block 0 there (masked).
    in_use = torch.arange(nb, device=table.device)[None, :] * block_size < lens[:, None]
    return torch.where(in_use, table[:, :nb].long(), 0).reshape(-1) * 2


def decode_group(table: torch.Tensor, lens: torch.Tensor, nb: int, rows: torch.Tensor | None,
                 kv_cache: torch.Tensor) -> AttentionGroup:
    """Sequences with one query each: their block-table rows, context lengths (device tensors, so a
    decode graph's metadata serves) and at most nb blocks of context."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    B = table.shape[0]
    mask = (torch.arange(nb * block_size, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]
    k_buf = kv_cache.new_empty(B * nb, block_size, num_kv_heads, head_dim)
    return AttentionGroup(rows, None, B, 1, _context_blocks(table, lens, nb, block_size), mask, k_buf,
                          torch.empty_like(k_buf))


def padded_group(table: torch.Tensor, seq_lens: list[int], q_lens: list[int], q_starts: list[int],
                 all_rows: bool, kv_cache: torch.Tensor, group_size: int) -> AttentionGroup:
    """Sequences with longer queries, padded to the longest: their block-table rows, context and
    query lengths and first query rows (host values); all_rows: they are the step's rows, in order."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    device = kv_cache.device
    B, max_q = len(seq_lens), max(q_lens)
    nb = -(-max(seq_lens) // block_size)
    lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
    # Query t of sequence i sits at position seq_len - q_len + t and sees keys up to it; a padding
    # query row (t >= q_len) sees the whole context (its output is dropped; a row seeing nothing
    # would be NaN). The rows of one KV head are its `group_size` query heads' max_q rows each.
    last = (lens - torch.tensor(q_lens, device=device))[:, None] + torch.arange(max_q, device=device)[None, :]
    key = torch.arange(nb * block_size, device=device)
    mask = (key[None, None, :] <= last[:, :, None]) & (key[None, None, :] < lens[:, None, None])  # [B, max_q, L]
    mask = mask[:, None, None].expand(B, 1, group_size, max_q, nb * block_size)
    mask = mask.reshape(B, 1, group_size * max_q, nb * block_size)
    rows = None if all_rows else torch.cat([torch.arange(s, s + n) for s, n in zip(q_starts, q_lens)]).to(device)
    pad_rows = torch.cat([torch.arange(i * max_q, i * max_q + n) for i, n in enumerate(q_lens)]).to(device)
    k_buf = kv_cache.new_empty(B * nb, block_size, num_kv_heads, head_dim)
    return AttentionGroup(rows, pad_rows, B, max_q, _context_blocks(table, lens, nb, block_size), mask, k_buf,
                          torch.empty_like(k_buf))


def plan_groups(meta: AttentionMetadata, kv_cache: torch.Tensor, num_heads: int, num_tokens: int) -> list[AttentionGroup]:
    """The step's SDPA calls (see the module's docstring)."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if meta.max_query_len == 1 and num_tokens == meta.num_seqs:
        # Pure decode: from the device tensors only. A decode graph's metadata has only placeholders
        # on the host (and max_seq_len at the model's limit).
        nb = min(-(-meta.max_seq_len // block_size), meta.block_tables.shape[1])
        return [decode_group(meta.block_tables, meta.seq_lens.long(), nb, None, kv_cache)]
    qsl = meta.query_start_loc_cpu.tolist()
    seq_lens = meta.seq_lens_cpu.tolist()
    n = len(seq_lens)
    decode = [i for i in range(n) if qsl[i + 1] - qsl[i] == 1]
    longer = [i for i in range(n) if qsl[i + 1] - qsl[i] > 1]
    device = kv_cache.device
    groups = []
    if decode:
        ids = torch.tensor(decode, dtype=torch.long, device=device)
        nb = -(-max(seq_lens[i] for i in decode) // block_size)
        groups.append(decode_group(meta.block_tables.index_select(0, ids),
                                   meta.seq_lens_cpu.to(device).index_select(0, ids).long(), nb,
                                   torch.tensor([qsl[i] for i in decode], dtype=torch.long, device=device), kv_cache))
    if longer:
        q_lens = [qsl[i + 1] - qsl[i] for i in longer]
        # One call for them all unless padding would more than double their rows: then one each.
        parts = [longer] if len(longer) * max(q_lens) <= 2 * sum(q_lens) else [[i] for i in longer]
        for p in parts:
            ids = torch.tensor(p, dtype=torch.long, device=device)
            groups.append(padded_group(meta.block_tables.index_select(0, ids), [seq_lens[i] for i in p],
                                       [qsl[i + 1] - qsl[i] for i in p], [qsl[i] for i in p],
                                       not decode and len(p) == n, kv_cache, num_heads // num_kv_heads))
    return groups


def plan_cpu_step(meta: AttentionMetadata, kv_cache: torch.Tensor, num_heads: int,
                  positions: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None) -> CpuStepPlan:
    """The per-step part of the CPU path (see the module's docstring)."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    slots = meta.slot_mapping
    keep = None
    if not bool((slots >= 0).all()):
        keep = (slots >= 0).nonzero()[:, 0]
        slots = slots[keep]
    rows = slots // block_size * (2 * block_size) + slots % block_size
    rot_cos = rot_sin = None
    if cos_sin is not None and cos_sin.shape[-1] == head_dim:
        # apply_rotary's x1*cos - x2*sin | x2*cos + x1*sin is x*[cos|cos] + roll(x)*[-sin|sin] (the
        # same products and sums, so the same bits); partial rotary goes through apply_rotary_qk
        cos, sin = cos_sin[positions].chunk(2, dim=-1)
        rot_cos, rot_sin = torch.cat([cos, cos], -1)[:, None, :], torch.cat([-sin, sin], -1)[:, None, :]
    groups = plan_groups(meta, kv_cache, num_heads, meta.slot_mapping.shape[0])
    return CpuStepPlan(meta, positions, cos_sin, (kv_cache.shape[1:], kv_cache.dtype), num_heads, rows, keep,
                       rot_cos, rot_sin, groups)


def rotate_qk_planned(q: torch.Tensor, k: torch.Tensor, plan: CpuStepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary of q and of k (bit for bit), in one pass with the plan's factors."""
    if plan.rot_cos is None:
        return apply_rotary_qk(q, k, plan.positions, plan.cos_sin)
    x = torch.cat([q, k], dim=1)
    xf = x.float()
    out = (xf * plan.rot_cos + xf.roll(x.shape[-1] // 2, -1) * plan.rot_sin).to(x.dtype)
    return out.split([q.shape[1], k.shape[1]], dim=1)


def store_kv_planned(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: CpuStepPlan) -> None:
    """store_kv_ref's writes (slot -1 rows skipped)."""
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if plan.store_keep is not None:
        k, v = k.index_select(0, plan.store_keep), v.index_select(0, plan.store_keep)
    flat = kv_cache.view(num_blocks * 2 * block_size, num_kv_heads * head_dim)
    flat.index_copy_(0, plan.store_rows, k.reshape(-1, num_kv_heads * head_dim).to(kv_cache.dtype))
    flat.index_copy_(0, plan.store_rows + block_size, v.reshape(-1, num_kv_heads * head_dim).to(kv_cache.dtype))


def attend_group(q: torch.Tensor, kv_cache: torch.Tensor, g: AttentionGroup, scale: float) -> torch.Tensor:
    """Attention of the group's query rows q [Tg, Hq, D] over their contexts: [Tg, Hq, D]."""
    Tg, num_heads, D = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group_size = num_heads // num_kv_heads
    B, max_q = g.num_seqs, g.max_q
    halves = kv_cache.view(-1, block_size, num_kv_heads, D)  # [num_blocks * 2, bs, Hkv, D]: K, V, K, V, ...
    k = torch.index_select(halves, 0, g.halves, out=g.k_buf).view(B, -1, num_kv_heads, D).transpose(1, 2)
    v = torch.index_select(halves, 0, g.halves + 1, out=g.v_buf).view(B, -1, num_kv_heads, D).transpose(1, 2)
    if max_q == 1:
        qg = q.reshape(B, num_kv_heads, group_size, D)
    else:
        padded = q.new_zeros(B * max_q, num_heads, D).index_copy_(0, g.pad_rows, q)
        qg = (padded.view(B, max_q, num_kv_heads, group_size, D).permute(0, 2, 3, 1, 4)
              .reshape(B, num_kv_heads, group_size * max_q, D))
    out = F.scaled_dot_product_attention(qg.float(), k.float(), v.float(), attn_mask=g.mask, scale=scale)
    if max_q == 1:
        return out.reshape(B, num_heads, D).to(q.dtype)
    out = out.view(B, num_kv_heads, group_size, max_q, D).permute(0, 3, 1, 2, 4).reshape(B * max_q, num_heads, D)
    return out.index_select(0, g.pad_rows).to(q.dtype)


def attend_planned(q: torch.Tensor, kv_cache: torch.Tensor, plan: CpuStepPlan, scale: float) -> torch.Tensor:
    """paged_attention_ref's result: every query row attends over its sequence's context."""
    if len(plan.groups) == 1 and plan.groups[0].rows is None:
        return attend_group(q, kv_cache, plan.groups[0], scale)
    out = torch.zeros_like(q)  # rows of sequences without queries stay zero, as in the reference
    for g in plan.groups:
        out.index_copy_(0, g.rows, attend_group(q.index_select(0, g.rows), kv_cache, g, scale))
    return out


class CpuAttention:
    """The reference backend's forward on CPU; the plan is made at a step's first layer and reused
    while the step's metadata, positions and rotary table are the same objects."""

    def __init__(self):
        self._plan: CpuStepPlan | None = None

    def forward(self, q, k, v, kv_cache, meta, scale, positions=None, cos_sin=None):
        plan = self._plan
        if plan is None or not plan.fits(meta, positions, cos_sin, kv_cache, q.shape[1]):
            plan = self._plan = plan_cpu_step(meta, kv_cache, q.shape[1], positions, cos_sin)
        if cos_sin is not None:
            q, k = rotate_qk_planned(q, k, plan)
        store_kv_planned(k, v, kv_cache, plan)
        return attend_planned(q, kv_cache, plan, scale)
