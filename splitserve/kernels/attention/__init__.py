"""Attention kernels (Triton) over the paged KV cache: paged_attention.py (ragged prefill and split-K
decode), store_kv.py (K/V into the cache, FP8 scales), cross_attention.py (decoder queries over the
encoder's K/V) and cross_ref.py (cross-attention's metadata and torch reference). The attention
backends and layers that call them are attention/; the custom ops are registered in kernels/ops.py."""
