"""Quantized linear layers: the method seam (base.py), the formats (one module each) and how a
checkpoint's or the flag's quantization is resolved (config.py).

Only names live here, so that building the command line imports no torch."""

# vLLM's names for the quantizations splitserve runs; `--quantization` takes these (None: whatever
# the checkpoint's quantization_config says).
from splitserve.config import QUANTIZATION_METHODS  # noqa: F401  (the names live with the config)
