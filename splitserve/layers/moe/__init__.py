"""Mixture-of-experts layers (Mixtral, Qwen2-MoE): routing and the layer around the fused kernel.

- router.py: router logits -> top-k expert ids and weights (softmax, top-k, optional renormalisation).
- layer.py: `FusedMoE`, the nn.Module (router, expert weights in one tensor each, optional Qwen2-MoE
  shared expert) with a loader for the Hugging Face checkpoint names.

The fused Triton kernels and their torch reference are kernels/moe/ (fused_moe.py, reference.py); the
`splitserve::fused_moe` custom op that dispatches between them is registered in kernels/ops.py.
Importing router / this package imports nothing heavy.
"""
