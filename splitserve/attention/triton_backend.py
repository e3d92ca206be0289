"""Triton attention backend: KV store + ragged paged attention (mixed batches) or split-K decode, with
T5's relative position bias when a layer has one, and cross-attention on the same kernels."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from splitserve.attention.backend import AttentionBackend, AttentionKernelSpec, AttentionMetadata, DecodeGraphState
from splitserve.kernels.attention.cross_attention import cross_decode_splits, cross_paged_attention, is_cross_decode
from splitserve.kernels.attention.cross_ref import CrossAttentionMetadata
from splitserve.kernels.attention.paged_attention import (
    default_num_splits, paged_decode_attention, ragged_paged_attention, ragged_variant)
from splitserve.kernels.attention.store_kv import store_kv


@dataclass
class TritonMetadata(AttentionMetadata):
    # The decode kernel's split count when it must not be chosen at launch: a decode graph fixes it
    # at capture (the grid is baked in), and the precompile fixes it to the count the engine will
    # use. None: default_num_splits picks it from the batch and max_seq_len at each launch.
    decode_num_splits: int | None = None


@dataclass
class TritonDecodeGraphState(DecodeGraphState):
    # What the split heuristic needs to fix each graph's split count: the KV heads, and the SM count
    # of `device`, or num_sms where it is known without CUDA (the precompile children).
    num_kv_heads: int = 0
    device: torch.device | None = None
    num_sms: int | None = None


def _with_splits(meta: AttentionMetadata, num_splits: int | None) -> TritonMetadata:
    return TritonMetadata(**{f.name: getattr(meta, f.name) for f in fields(AttentionMetadata)},
                          decode_num_splits=num_splits)


class TritonBackend(AttentionBackend):
    name = "triton"
    jit_kernels = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, positions: torch.Tensor | None = None,
                cos_sin: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                soft_cap: float | None = None, pos_bias: torch.Tensor | None = None) -> torch.Tensor:
        if pos_bias is not None and soft_cap is not None:
            raise ValueError("a relative position bias together with a logit soft cap is not supported")
        rotated = store_kv(k, v, kv_cache, meta.slot_mapping, q, positions, cos_sin, k_scale, v_scale)  # one pass
        return self.attend(q if rotated is None else rotated, kv_cache, meta, scale, k_scale, v_scale,
                           sliding_window, soft_cap, pos_bias)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               sliding_window: int | None = None, soft_cap: float | None = None,
               pos_bias: torch.Tensor | None = None) -> torch.Tensor:
        # The decode kernel maps q row b to sequence b, which holds only when every sequence has
        # exactly one query token: T == B (both host-known shapes) together with max_query_len == 1.
        if meta.is_pure_decode and q.shape[0] == meta.num_seqs:
            # Metadata built outside build_metadata (tests; the runner's own layout) is the plain
            # AttentionMetadata, which never fixes the split count.
            num_splits = meta.decode_num_splits if isinstance(meta, TritonMetadata) else None
            return paged_decode_attention(q, kv_cache, meta.seq_lens, meta.block_tables, meta.max_seq_len,
                                          scale, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
                                          sliding_window=sliding_window, soft_cap=soft_cap, pos_bias=pos_bias)
        return ragged_paged_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                      meta.max_query_len, meta.max_seq_len, scale, k_scale=k_scale, v_scale=v_scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap, pos_bias=pos_bias)

    # -- cross-attention (encoder-decoder models) ------------------------------------------------------
    def cross_forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: CrossAttentionMetadata,
                      scale: float) -> torch.Tensor:
        """The Triton kernels (ops/cross_attention.py): a decode step reads no host value, so the
        decode graphs capture it at the bounds of capture_cross_metadata."""
        return cross_paged_attention(q, kv_cache, meta.query_start_loc, meta.enc_lens, meta.block_tables,
                                     meta.max_query_len, meta.max_enc_len, scale)

    # -- metadata ------------------------------------------------------------------------------------
    def build_metadata(self, slot_mapping, query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len,
                       query_start_loc_cpu, seq_lens_cpu) -> TritonMetadata:
        return TritonMetadata(slot_mapping, query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len,
                              query_start_loc_cpu, seq_lens_cpu)

    # -- full CUDA graphs of pure-decode steps -------------------------------------------------------
    def decode_graph_state(self, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                           num_kv_heads: int, device: torch.device) -> TritonDecodeGraphState:
        return self._decode_graph_state(max_num_seqs, max_blocks_per_seq, max_model_len, num_kv_heads, device)

    def _decode_graph_state(self, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                            num_kv_heads: int, device: torch.device, num_sms: int | None = None):
        base = super().decode_graph_state(max_num_seqs, max_blocks_per_seq, max_model_len, num_kv_heads, device)
        return TritonDecodeGraphState(**{f.name: getattr(base, f.name) for f in fields(DecodeGraphState)},
                                      num_kv_heads=num_kv_heads, device=device, num_sms=num_sms)

    def capture_metadata(self, state: TritonDecodeGraphState, num_seqs: int) -> TritonMetadata:
        # The split count the heuristic gives this batch size at the model's longest context: the
        # graph replays for any lengths up to it, and long contexts are where splits pay off.
        num_splits = default_num_splits(num_seqs, state.num_kv_heads, state.max_model_len, state.device,
                                        num_sms=state.num_sms)
        return _with_splits(super().capture_metadata(state, num_seqs), num_splits)

    # -- start-up precompile -------------------------------------------------------------------------
    def precompile_launches(self, spec: AttentionKernelSpec, warm_up: Sequence[AttentionMetadata],
                            device: torch.device) -> list[Callable[[], object]]:
        """The KV store (one variant), then each warm-up step and decode graph whose kernel variant
        (decode with or without splits, or the ragged kernel's compile-time configuration) is new.
        Every decode launch carries its split count, computed from spec.num_sms: the precompile
        children must never ask CUDA for the SM count. With spec.pos_bias every attention launch
        carries a bias table (its length is not specialized); with spec.cross_max_enc_len the
        cross-attention launches follow (_cross_launches)."""
        hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        launches = [_store_launch(spec, device)]
        cache = torch.empty(1, 2, spec.block_size, hkv, d, dtype=spec.kv_dtype or spec.dtype, device=device)
        k_scale, v_scale = _scales(device)
        seen = set()

        def add(variant, meta: AttentionMetadata, window: int | None, soft_cap: float | None) -> None:
            if (variant, window, soft_cap) not in seen:
                seen.add((variant, window, soft_cap))
                q = torch.empty(meta.slot_mapping.shape[0], hq, d, dtype=spec.dtype, device=device)
                # The layer's window and cap as keywords (a layer without them passes none).
                extra = {k: x for k, x in (("sliding_window", window), ("soft_cap", soft_cap)) if x is not None}
                if spec.pos_bias:
                    extra["pos_bias"] = torch.empty(hq, 2 * spec.block_size, dtype=torch.float32, device=device)
                launches.append(functools.partial(self.attend, q, cache, meta, d ** -0.5, k_scale, v_scale, **extra))

        for window, soft_cap in spec.attn_variants:  # each kind of layer launches its own variants
            for meta in warm_up:
                num_tokens = meta.slot_mapping.shape[0]
                if meta.is_pure_decode and num_tokens == meta.num_seqs:  # attend's own dispatch
                    read = min(meta.max_seq_len, window or meta.max_seq_len)  # as paged_decode_attention splits
                    splits = default_num_splits(meta.num_seqs, hkv, read, num_sms=spec.num_sms)
                    add(("decode", splits > 1), _with_splits(meta, splits), window, soft_cap)
                else:
                    add(("ragged", ragged_variant(num_tokens, meta.num_seqs, meta.max_query_len, meta.max_seq_len,
                                                  hq, hkv, d)), meta, window, soft_cap)
            if spec.decode_batch_sizes:
                state = self._decode_graph_state(max(spec.decode_batch_sizes),
                                                 -(-spec.max_model_len // spec.block_size),
                                                 spec.max_model_len, hkv, device, num_sms=spec.num_sms)
                for bs in spec.decode_batch_sizes:
                    meta = self.capture_metadata(state, bs)
                    add(("decode", meta.decode_num_splits > 1), meta, window, soft_cap)
        if spec.cross_max_enc_len:
            launches += _cross_launches(spec, warm_up, cache, device)
        return launches


def _cross_launches(spec: AttentionKernelSpec, warm_up: Sequence[AttentionMetadata], cache: torch.Tensor,
                    device: torch.device) -> list[Callable[[], object]]:
    """Cross-attention's kernel variants: the decode kernel with and/or without splits as the decode
    graphs (one query per sequence, the cross state's bound) and the warm-up's decode steps use it,
    and the non-causal ragged kernel for each warm-up layout with longer queries (its encoder
    lengths at the bound)."""
    hq, hkv, d, max_enc = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.cross_max_enc_len
    enc_blocks = -(-max_enc // spec.block_size)
    launches, seen = [], set()

    def add(num_tokens: int, num_seqs: int, max_query_len: int, qsl: torch.Tensor) -> None:
        if is_cross_decode(num_tokens, num_seqs, max_query_len):
            splits = cross_decode_splits(num_seqs, hkv, max_enc, num_sms=spec.num_sms)
            variant = ("decode", splits > 1)
        else:
            splits = None
            variant = ("ragged", ragged_variant(num_tokens, num_seqs, max_query_len, max_enc, hq, hkv, d))
        if variant in seen:
            return
        seen.add(variant)
        q = torch.empty(num_tokens, hq, d, dtype=spec.dtype, device=device)
        enc_lens = torch.empty(num_seqs, dtype=torch.int32, device=device)
        table = torch.empty(num_seqs, enc_blocks, dtype=torch.int32, device=device)
        launches.append(functools.partial(cross_paged_attention, q, cache, qsl, enc_lens, table, max_query_len,
                                          max_enc, d ** -0.5, num_splits=splits))

    for meta in warm_up:
        add(meta.slot_mapping.shape[0], meta.num_seqs, meta.max_query_len, meta.query_start_loc)
    for bs in spec.decode_batch_sizes:
        add(bs, bs, 1, torch.empty(bs + 1, dtype=torch.int32, device=device))
    return launches


def _store_launch(spec: AttentionKernelSpec, device: torch.device) -> Callable[[], object]:
    """The KV store as the model calls it: q, k and v are views of one projection's output."""
    n, hq, hkv, d = spec.block_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = torch.empty(n, (hq + 2 * hkv) * d, dtype=spec.dtype, device=device).split([hq * d, hkv * d, hkv * d], -1)
    cache = torch.empty(1, 2, n, hkv, d, dtype=spec.kv_dtype or spec.dtype, device=device)
    cos_sin = torch.empty(n, spec.rot_dim, dtype=torch.float32, device=device) if spec.rot_dim else None
    return functools.partial(store_kv, k.view(n, hkv, d), v.view(n, hkv, d), cache,
                             torch.empty(n, dtype=torch.long, device=device), q.view(n, hq, d),
                             torch.empty(n, dtype=torch.long, device=device), cos_sin, *_scales(device))


def _scales(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for an attention layer's k_scale / v_scale buffers (one fp32 value each)."""
    return torch.ones(1, dtype=torch.float32, device=device), torch.ones(1, dtype=torch.float32, device=device)
