"""Mixture-of-experts layers (Mixtral, Qwen2-MoE): routing, the fused Triton kernel and its torch reference.

- router.py: router logits -> top-k expert ids and weights (softmax, top-k, optional renormalisation).
- reference.py: the plain torch definition of the expert computation (the tests' reference, the CPU path).
- fused_moe.py: the Triton path over the flat token stream (align pairs by expert, two grouped GEMMs,
  SiLU-and-mul fused into the first) and the `splitserve::fused_moe` custom op that dispatches.
- layer.py: `FusedMoE`, the nn.Module (router, expert weights in one tensor each, optional Qwen2-MoE
  shared expert) with a loader for the Hugging Face checkpoint names.

Triton is imported by fused_moe.py only; importing router / reference / this package imports nothing heavy.
"""
