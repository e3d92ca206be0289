"""The batchless seam: attention metadata and the backend interface.

A backend stores the step's new K/V into the paged cache and attends every query token over its own
sequence's context, for all sequences of the step at once (ragged layout, mixed prefill + decode).
Everything that depends on how a backend works lives behind this interface, next to its forward:
the metadata it needs (`build_metadata`), what a full CUDA graph of a decode step needs
(`decode_graph_state` / `capture_metadata` / `prepare_replay`), and which kernels it compiles at
start-up (`precompile_launches`). The runner, the graphs and the start-up machinery only call these.
This module defines the interface; attention/registry.py picks a backend by name.

Layouts (shared by every backend and kernel):
  q            [num_tokens, num_heads, head_dim]
  k, v         [num_tokens, num_kv_heads, head_dim]
  kv_cache     [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0: K, 1: V), in the model's
               dtype or FP8 e4m3 (torch.float8_e4m3fn): then K is stored as clamp(k / k_scale, ±448)
               rounded to e4m3 and read back as stored * k_scale (V likewise with v_scale); k_scale
               and v_scale are one-element fp32 device tensors of the layer (1.0 when None)
  slot_mapping [num_tokens] int64, slot = block_id * block_size + offset; -1 = padding, not stored
  Sequence i owns query tokens query_start_loc[i]:query_start_loc[i+1]; they are the LAST
  q_len_i tokens of its context of seq_lens[i] tokens (positions seq_lens[i]-q_len_i .. seq_lens[i]-1),
  and attend causally over context positions 0..own position, read through block_tables[i].
  With a sliding window W (per layer, an argument of forward) a query at position p sees only key
  positions p - W < n <= p (W keys, its own included; transformers' convention), and a block wholly
  before every query's window may be missing: its table entry is unspecified (the KV manager may have
  freed it, see core/kv_cache_manager.py), so backends must not read it. With a soft cap c (Gemma 2)
  the scaled logits s become c * tanh(s / c) before the softmax.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitserve.kernels.attention.cross_ref import CrossAttentionMetadata, cross_attention_padded, store_cross_kv_ref

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite e4m3 value: stores saturate there


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64 (device)
    query_start_loc: torch.Tensor   # [B+1] int32 (device)
    seq_lens: torch.Tensor          # [B] int32 (device)
    block_tables: torch.Tensor      # [B, max_blocks_per_seq] int32 (device)
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor  # host copies: for backends that loop on the host
    seq_lens_cpu: torch.Tensor
    # Encoder-decoder models: the step's cross-attention layout (kernels/attention/cross_ref.py); None else.
    cross: CrossAttentionMetadata | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class DecodeGraphState:
    """The static metadata buffers every full decode graph reads (max_num_seqs rows; the graph of B
    sequences reads the first B). Their addresses are baked into the graphs, so replays refill them
    in place. A backend whose graphs need more keeps it in a subclass."""
    slot_mapping: torch.Tensor      # [N] int64, -1: a padding row stores nothing
    query_start_loc: torch.Tensor   # [N+1] int32, 0..N: one query token per sequence, never rewritten
    seq_lens: torch.Tensor          # [N] int32, 0 for padding rows
    block_tables: torch.Tensor      # [N, max_blocks_per_seq] int32
    max_model_len: int


@dataclass
class CrossGraphState:
    """Static cross-attention buffers of decode graphs (encoder-decoder models): each sequence's
    encoder length (0 in padding rows) and cross block table, refilled in place before a replay."""
    enc_lens: torch.Tensor          # [N] int32
    block_tables: torch.Tensor      # [N, max_enc_blocks] int32
    query_start_loc: torch.Tensor   # [N+1] int32, 0..N
    max_enc_len: int


@dataclass(frozen=True)
class AttentionKernelSpec:
    """Everything that decides which kernel variants the engine launches at start-up, in plain data
    (it crosses into the precompile children)."""
    backend: str                         # registry name
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    budget: int                          # max_num_batched_tokens
    max_model_len: int
    decode_batch_sizes: tuple[int, ...]  # the decode graphs' batch sizes
    num_sms: int                         # the GPU's SM count (what launch heuristics see)
    capability: int                      # e.g. 90 for sm_90
    rot_dim: int                         # rotary width (a backend may apply it in its KV store); 0: none
    kv_dtype: torch.dtype | None = None  # the KV cache's dtype; None: dtype
    # The distinct (sliding_window, soft_cap) pairs of the model's attention layers (None: none).
    attn_variants: tuple[tuple[int | None, float | None], ...] = ((None, None),)
    # Whether the self-attention layers carry a relative position bias table (T5's decoder).
    pos_bias: bool = False
    # Encoder-decoder models: the longest encoder input a decode graph's cross-attention reads (the
    # cross graph state's max_enc_len); 0: the model has no cross-attention.
    cross_max_enc_len: int = 0


class AttentionBackend:
    name = "base"
    # Whether the backend's kernels compile on their first launch, so that start-up should compile
    # its precompile_launches in child processes (startup/kernel_precompile.py).
    jit_kernels = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, positions: torch.Tensor | None = None,
                cos_sin: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                soft_cap: float | None = None, pos_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Stores k/v and attends. With a rotary table (cos_sin, see layers/rotary.apply_rotary) q and
        k are first rotated at `positions`: the model hands them over straight from its projection.
        k_scale / v_scale: the FP8 cache's scales (see the layouts above); ignored for other caches.
        sliding_window / soft_cap: the layer's window and logit cap (see above); None: none.
        pos_bias: [num_heads, max_len] fp32, added to the scaled logit of a query at p and a key at n
        as pos_bias[h, p - n] (T5's relative position buckets, tabulated once by the model); None: none."""
        raise NotImplementedError

    # -- cross-attention (encoder-decoder models) ------------------------------------------------------
    def cross_forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: CrossAttentionMetadata,
                      scale: float) -> torch.Tensor:
        """Each decoder query over its sequence's encoder K/V (non-causal, ragged encoder lengths).
        KERNEL PLUG-IN POINT: the default is the padded torch maths (kernels/attention/cross_ref.py), which
        reads no host value and so can be captured in a decode graph; a backend may override it."""
        return cross_attention_padded(q, kv_cache, meta, scale)

    def store_cross_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slots: torch.Tensor) -> None:
        """Writes a step's encoder K/V ([E, Hkv, D]) into the cross blocks at `slots` ([E] int64)."""
        store_cross_kv_ref(k, v, kv_cache, slots)

    def cross_graph_state(self, max_num_seqs: int, max_enc_blocks: int, block_size: int,
                          device: torch.device) -> CrossGraphState:
        n = max_num_seqs
        return CrossGraphState(torch.zeros(n, dtype=torch.int32, device=device),
                               torch.zeros(n, max_enc_blocks, dtype=torch.int32, device=device),
                               torch.arange(n + 1, dtype=torch.int32, device=device), max_enc_blocks * block_size)

    def capture_cross_metadata(self, state: CrossGraphState, num_seqs: int) -> CrossAttentionMetadata:
        """The cross metadata a decode graph of num_seqs sequences is captured with: views of the
        state's buffers, one query each, contexts padded to the longest encoder input."""
        b = num_seqs
        return CrossAttentionMetadata(state.query_start_loc[:b + 1], state.enc_lens[:b], state.block_tables[:b],
                                      1, state.max_enc_len, torch.zeros(b, dtype=torch.int32),
                                      torch.arange(b + 1, dtype=torch.int32))

    def prepare_cross_replay(self, state: CrossGraphState, meta: CrossAttentionMetadata, padded: int) -> None:
        """Copies a decode step's cross metadata into the state before the graph of `padded` rows
        replays; padding rows get encoder length 0 (their output is zeros, ignored)."""
        n = meta.num_seqs
        state.enc_lens[:n].copy_(meta.enc_lens)
        state.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if padded > n:
            state.enc_lens[n:padded].fill_(0)

    # -- metadata ------------------------------------------------------------------------------------
    def build_metadata(self, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                       block_tables: torch.Tensor, max_query_len: int, max_seq_len: int,
                       query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor) -> AttentionMetadata:
        """This backend's metadata for a step's ragged layout (device tensors plus host copies)."""
        return AttentionMetadata(slot_mapping, query_start_loc, seq_lens, block_tables, max_query_len,
                                 max_seq_len, query_start_loc_cpu, seq_lens_cpu)

    # -- full CUDA graphs of pure-decode steps -------------------------------------------------------
    def decode_graph_state(self, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                           num_kv_heads: int, device: torch.device) -> DecodeGraphState:
        """Allocates the static metadata buffers of decode graphs of up to max_num_seqs sequences
        (the caller decides the tensors' mode, e.g. inference_mode)."""
        n = max_num_seqs
        return DecodeGraphState(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=device),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=device),
            block_tables=torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            max_model_len=max_model_len)

    def capture_metadata(self, state: DecodeGraphState, num_seqs: int) -> AttentionMetadata:
        """The metadata the decode graph of num_seqs sequences is captured with: views of the state's
        buffers, one query token each. The lengths are known only on the device when the graph
        replays, so max_seq_len is the model's limit and the host copies are placeholders."""
        b = num_seqs
        return AttentionMetadata(
            slot_mapping=state.slot_mapping[:b], query_start_loc=state.query_start_loc[:b + 1],
            seq_lens=state.seq_lens[:b], block_tables=state.block_tables[:b], max_query_len=1,
            max_seq_len=state.max_model_len, query_start_loc_cpu=torch.arange(b + 1, dtype=torch.int32),
            seq_lens_cpu=torch.zeros(b, dtype=torch.int32))

    def prepare_replay(self, state: DecodeGraphState, meta: AttentionMetadata, padded: int) -> None:
        """Copies a pure-decode step's metadata (meta.num_seqs sequences, device tensors) into the
        state's buffers before the graph of `padded` sequences replays. Padding rows store nothing
        (slot -1) and attend over nothing (length 0); their outputs are ignored."""
        n = meta.num_seqs
        state.slot_mapping[:n].copy_(meta.slot_mapping)
        state.seq_lens[:n].copy_(meta.seq_lens)
        state.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if padded > n:
            state.slot_mapping[n:padded].fill_(-1)
            state.seq_lens[n:padded].fill_(0)

    # -- start-up precompile -------------------------------------------------------------------------
    def precompile_launches(self, spec: AttentionKernelSpec, warm_up: Sequence[AttentionMetadata],
                            device: torch.device) -> list[Callable[[], object]]:
        """One call per distinct kernel variant the engine's start-up launches: the warm-up steps
        (`warm_up`, their metadata on `device`) and the decode graphs (spec.decode_batch_sizes), on
        tensors of `device` laid out like the engine's. startup/kernel_precompile.py runs them in
        children with Triton in compile-only mode, on meta tensors. Empty: nothing to precompile."""
        return []
