"""HF `architectures` name -> model class, imported lazily."""
from __future__ import annotations

import importlib

from splitserve.models.families import ARCHITECTURES

_MODELS = {
    # text decoders: one configurable decoder, the family read from the config's model_type
    **{arch: ("splitserve.models.decoder", "DecoderForCausalLM") for arch in ARCHITECTURES.values()},
    # vision-language models
    "LlavaForConditionalGeneration": ("splitserve.models.llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("splitserve.models.llava", "LlavaNextForConditionalGeneration"),
    "LlavaLlamaModel": ("splitserve.models.vila", "VilaForConditionalGeneration"),
    "LlavaLlamaForCausalLM": ("splitserve.models.vila", "VilaForConditionalGeneration"),
    # encoder-decoder models (cross-attention: attention/cross.py)
    "T5ForConditionalGeneration": ("splitserve.models.t5", "T5ForConditionalGeneration"),
    "Pix2StructForConditionalGeneration": ("splitserve.models.pix2struct", "Pix2StructForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None):
    for arch in architectures or []:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return arch, getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported model architecture {architectures}; supported: {', '.join(supported_architectures())}")
