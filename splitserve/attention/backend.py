"""The batchless seam: attention metadata and the backend interface.

A backend stores the step's new K/V into the paged cache and attends every query token over its own
sequence's context, for all sequences of the step at once (ragged layout, mixed prefill + decode).

Layouts (shared by every backend and kernel):
  q            [num_tokens, num_heads, head_dim]
  k, v         [num_tokens, num_kv_heads, head_dim]
  kv_cache     [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0: K, 1: V)
  slot_mapping [num_tokens] int64, slot = block_id * block_size + offset; -1 = padding, not stored
  Sequence i owns query tokens query_start_loc[i]:query_start_loc[i+1]; they are the LAST
  q_len_i tokens of its context of seq_lens[i] tokens (positions seq_lens[i]-q_len_i .. seq_lens[i]-1),
  and attend causally over context positions 0..own position, read through block_tables[i].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend:
    name = "base"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, positions: torch.Tensor | None = None,
                cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        """Stores k/v and attends. With a rotary table (cos_sin, see layers/rotary.apply_rotary) q and
        k are first rotated at `positions`: the model hands them over straight from its projection."""
        raise NotImplementedError


def get_backend(name: str) -> AttentionBackend:
    if name == "torch_ref":
        from splitserve.attention.torch_ref import TorchRefBackend
        return TorchRefBackend()
    if name == "triton":
        from splitserve.attention.triton_backend import TritonBackend
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch_ref' or 'triton'")
