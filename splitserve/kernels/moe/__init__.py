"""The fused mixture-of-experts Triton kernels (fused_moe.py) and their plain torch reference
(reference.py). The MoE layer (router, weights, loader) is layers/moe/; the `splitserve::fused_moe`
custom op is registered in kernels/ops.py."""
