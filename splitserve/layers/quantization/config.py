"""Which quantization a model runs with: the checkpoint's `quantization_config` (config.json, or a
ModelOpt `hf_quant_config.json` beside it), or `--quantization NAME` (vLLM's names).

- No flag: the checkpoint decides; a float checkpoint runs unquantized.
- A flag naming the checkpoint's own format: the same.
- `--quantization fp8` on a float checkpoint (or a GGUF file, which loads as float): online FP8.
- Anything else is a ValueError that says what the checkpoint holds and what is supported.
"""
from __future__ import annotations

import json
import os

from splitserve.layers.quantization import QUANTIZATION_METHODS
from splitserve.layers.quantization.base import QuantConfig

# Names vLLM knows that splitserve does not run (yet): a clearer message than "unknown".
_NOT_YET = ("gptq_marlin", "awq_marlin", "marlin", "bitsandbytes", "gguf", "fbgemm_fp8",
            "ptpc_fp8", "modelopt_fp4", "mxfp4", "torchao", "quark", "hqq", "auto-round", "experts_int8")
_ALIASES = {"compressed_tensors": "compressed-tensors"}


def _supported() -> str:
    return ", ".join(QUANTIZATION_METHODS)


def checkpoint_quantization(hf_config, directory: str | None) -> dict | None:
    """The checkpoint's quantization settings as a dict with `quant_method`, or None."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        qc = getattr(config, "quantization_config", None) if config is not None else None
        if qc is not None:
            qc = qc if isinstance(qc, dict) else qc.to_dict()
            return dict(qc)
    path = os.path.join(directory, "hf_quant_config.json") if directory else None
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return {"quant_method": "modelopt", **json.load(f)}
    return None


def _build(method: str, cfg: dict) -> QuantConfig:
    if method == "fp8":
        from splitserve.layers.quantization.fp8 import Fp8Config
        return Fp8Config.from_checkpoint(cfg)
    if method == "compressed-tensors":
        from splitserve.layers.quantization.compressed_tensors import CompressedTensorsConfig
        return CompressedTensorsConfig(cfg)
    if method == "gptq":
        from splitserve.layers.quantization.wna16 import GPTQConfig
        return GPTQConfig.from_checkpoint(cfg)
    if method == "awq":
        from splitserve.layers.quantization.wna16 import AWQConfig
        return AWQConfig.from_checkpoint(cfg)
    from splitserve.layers.quantization.modelopt import ModelOptConfig
    return ModelOptConfig(cfg)


def resolve_quant_config(requested: str | None, hf_config, directory: str | None) -> QuantConfig | None:
    """`requested`: the `--quantization` value (None: from the checkpoint). `directory`: where the
    checkpoint's files are (None for a GGUF file, whose tensors load as float)."""
    if requested is not None:
        requested = _ALIASES.get(requested, requested)
        if requested not in QUANTIZATION_METHODS:
            kind = "not supported yet" if requested in _NOT_YET else "unknown"
            raise ValueError(f"quantization {requested!r} is {kind}; supported: {_supported()} "
                             f"(or leave it unset to follow the checkpoint)")
    cfg = checkpoint_quantization(hf_config, directory)
    if cfg is None:
        if requested is None:
            return None
        if requested == "fp8":
            from splitserve.layers.quantization.fp8 import Fp8Config
            return Fp8Config.online()
        raise ValueError(f"quantization {requested!r} needs a checkpoint quantized in that format, and this one "
                         f"has no quantization_config (only 'fp8' quantizes a float checkpoint at load)")
    method = str(cfg.get("quant_method", "")).lower()
    method = _ALIASES.get(method, method)
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"the checkpoint is quantized with {method or 'an unnamed method'!r}, which splitserve "
                         f"does not support yet; supported: {_supported()}")
    if requested is not None and requested != method:
        raise ValueError(f"quantization {requested!r} was asked for, but the checkpoint is quantized with "
                         f"{method!r}; leave it unset or pass {method!r}")
    return _build(method, cfg)
