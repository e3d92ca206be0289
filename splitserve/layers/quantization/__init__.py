"""Quantized linear layers: the method seam (base.py), the formats (one module each) and how a
checkpoint's or the flag's quantization is resolved (config.py).

Only names live here, so that building the command line imports no torch."""

# vLLM's names for the quantizations splitserve runs; `--quantization` takes these (None: whatever
# the checkpoint's quantization_config says).
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt", "gptq", "awq")
