"""Every GPU kernel of splitserve (Triton and Gluon), each beside its plain torch reference, and the one
place that registers the custom ops (ops.py).

- attention/: the paged attention kernels (prefill/decode over the paged KV cache, KV store, FP8 KV
  scales) and the cross-attention kernel with its torch reference (cross_ref.py).
- gemm/: the quantized GEMM/GEMV kernels: fp8/, int8/, wna16/, the shared split-K machinery
  (_split_k.py), one tile-config type (tiles.py), the fused silu-mul + per-token quantization
  (act_quant.py) and the torch references (reference.py).
- moe/: the fused mixture-of-experts kernels and their torch reference (the layer is layers/moe/).
- lora/: the multi-LoRA shrink/expand kernels and the token -> slot tile layout with its reference.
- ops.py: every torch.library custom op and its fake (meta) implementation.

This room sits below attention/, layers/ and lora/: it imports only torch, Triton, splitserve.config,
splitserve.parallel and splitserve.cpu_limits. Triton / Gluon are imported by the kernel modules
only, and Gluon modules only where their kernels run; importing this package imports nothing heavy.
"""
