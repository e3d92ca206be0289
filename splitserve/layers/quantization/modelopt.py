"""NVIDIA ModelOpt FP8 checkpoints: `hf_quant_config.json` beside the weights, or a
`quantization_config` with `quant_method: modelopt` in config.json.

`quant_algo` FP8: FP8 weights with one scale per tensor (`weight_scale`, a scalar; the shards of a
merged layer each have their own) and a static per-tensor activation scale (`input_scale`).
FP8_PER_CHANNEL_PER_TOKEN: a scale per output channel, dynamic per-token activations.
`exclude_modules` names (or, with * and ?, globs over) the modules left unquantized. KV-cache
scales (`k_scale`, `v_scale`) are left unused while the KV cache is not FP8.
"""
from __future__ import annotations

import fnmatch
import logging
import re

from splitserve.layers.quantization.base import UNQUANTIZED, LinearMethod, QuantConfig, name_variants, same_method
from splitserve.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme, name_matches

logger = logging.getLogger(__name__)

NAME = "modelopt"
_SCHEMES = {
    "FP8": Fp8Scheme("tensor", "static"),
    "FP8_PER_CHANNEL_PER_TOKEN": Fp8Scheme("channel", "token"),
}
_KV_SCALE = re.compile(r"\.(k_scale|v_scale)$")


def flatten_modelopt_config(cfg: dict) -> dict:
    """hf_quant_config.json nests the settings under "quantization"; config.json may or may not."""
    inner = cfg.get("quantization")
    return {**cfg, **inner} if isinstance(inner, dict) else dict(cfg)


class ModelOptConfig(QuantConfig):
    name = NAME

    def __init__(self, cfg: dict):
        cfg = flatten_modelopt_config(cfg)
        algo = cfg.get("quant_algo")
        if algo not in _SCHEMES:
            raise ValueError(f"{NAME}: quant_algo {algo!r} is not supported (supported: {', '.join(_SCHEMES)})")
        self.algo = algo
        self.method = Fp8LinearMethod(NAME, _SCHEMES[algo])
        self.exclude = list(cfg.get("exclude_modules") or cfg.get("ignore") or [])
        self.kv_cache_algo = cfg.get("kv_cache_quant_algo")
        if self.kv_cache_algo:
            logger.warning("%s: the checkpoint's KV-cache scales (%s) are not used; the KV cache stays in the "
                           "model's dtype", NAME, self.kv_cache_algo)

    def _excluded(self, name: str) -> bool:
        for pattern in self.exclude:
            if any(c in pattern for c in "*?["):
                if any(fnmatch.fnmatchcase(n, pattern) for n in name_variants(name)):
                    return True
            elif name_matches(name, pattern):
                return True
        return False

    def linear_method(self, names: list[str]) -> LinearMethod:
        return same_method([UNQUANTIZED if self._excluded(n) else self.method for n in names], names)

    def skip_tensor(self, name: str) -> bool:
        return _KV_SCALE.search(name) is not None

    def describe(self) -> str:
        return self.method.describe()
