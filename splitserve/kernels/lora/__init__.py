"""Multi-LoRA kernels: the Triton shrink/expand kernels (shrink_expand.py) and the token -> slot tile
layout, the torch reference and the dispatcher of the delta (lora_add.py). The `splitserve::lora_add_`
custom op is registered in kernels/ops.py."""
