"""HF `architectures` name -> model class, and -> the class of its front-side hooks
(models/<name>/processor.py), each imported lazily by module name: looking up a processor or a config
reader imports no model code."""
from __future__ import annotations

import importlib

from splitserve.loading.architectures import ARCHITECTURES
from splitserve.loading.hf_config import config_model_type

_MODELS = {
    # text decoders: one configurable decoder, the family read from the config's model_type
    **{arch: ("splitserve.models.decoder", "DecoderForCausalLM") for arch in ARCHITECTURES.values()},
    # vision-language models
    "LlavaForConditionalGeneration": ("splitserve.models.llava.model", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("splitserve.models.llava.model", "LlavaNextForConditionalGeneration"),
    "LlavaLlamaModel": ("splitserve.models.vila.model", "VilaForConditionalGeneration"),
    "LlavaLlamaForCausalLM": ("splitserve.models.vila.model", "VilaForConditionalGeneration"),
    # encoder-decoder models (cross-attention: attention/cross.py)
    "T5ForConditionalGeneration": ("splitserve.models.t5.model", "T5ForConditionalGeneration"),
    "Pix2StructForConditionalGeneration": ("splitserve.models.pix2struct.model", "Pix2StructForConditionalGeneration"),
    # Swin + mBART only (Nougat); other encoder/decoder pairs are refused by name (nougat.supported_pair)
    "VisionEncoderDecoderModel": ("splitserve.models.nougat.model", "NougatForConditionalGeneration"),
    "Phi3VForCausalLM": ("splitserve.models.phi3v.model", "Phi3VForCausalLM"),
    "CogVLMForCausalLM": ("splitserve.models.cogvlm.model", "CogVLMForCausalLM"),
    "Blip2ForConditionalGeneration": ("splitserve.models.blip2.model", "Blip2ForConditionalGeneration"),
    "FuyuForCausalLM": ("splitserve.models.fuyu.model", "FuyuForCausalLM"),
    "Kosmos2ForConditionalGeneration": ("splitserve.models.kosmos2.model", "Kosmos2ForConditionalGeneration"),
    "NevaForCausalLM": ("splitserve.models.neva.model", "NevaForCausalLM"),  # .nemo archives (nemo_archive.py)
}

# architecture -> the front-side half of an image-taking model (prompt expansion, image processing):
# a processor module imports no model code, and its class builds from the config alone (`from_config`).
# Pix2Struct and Nougat bring processors of their own (mm_processor_class), not listed here.
_PROCESSORS = {
    "LlavaForConditionalGeneration": ("splitserve.models.llava.processor", "LlavaProcessing"),
    "LlavaNextForConditionalGeneration": ("splitserve.models.llava.processor", "LlavaNextProcessing"),
    "LlavaLlamaModel": ("splitserve.models.vila.processor", "VilaProcessing"),
    "LlavaLlamaForCausalLM": ("splitserve.models.vila.processor", "VilaProcessing"),
    "Phi3VForCausalLM": ("splitserve.models.phi3v.processor", "Phi3VProcessing"),
    "CogVLMForCausalLM": ("splitserve.models.cogvlm.processor", "CogVLMProcessing"),
    "Blip2ForConditionalGeneration": ("splitserve.models.blip2.processor", "Blip2Processing"),  # OPT and T5
    "FuyuForCausalLM": ("splitserve.models.fuyu.processor", "FuyuProcessing"),
    "Kosmos2ForConditionalGeneration": ("splitserve.models.kosmos2.processor", "Kosmos2Processing"),
    "NevaForCausalLM": ("splitserve.models.neva.processor", "NevaProcessing"),
}


def get_processor_class(architectures: list[str] | None):
    """The front-side hooks class (ImagePromptHooks) of an image-taking architecture, None for others;
    `cls.from_config(hf_config)` gives what multimodal/processor.MultiModalProcessor reads."""
    for arch in architectures or []:
        if arch in _PROCESSORS:
            module, name = _PROCESSORS[arch]
            return getattr(importlib.import_module(module), name)
    return None


# config.json model_type (or architecture) -> (module, function(directory) -> config) for
# checkpoints whose config transformers cannot read (remote code only).
_CONFIG_READERS = {
    "phi3_v": ("splitserve.models.phi3v.config", "load_phi3v_config"),
    "CogVLMForCausalLM": ("splitserve.models.cogvlm.config", "load_cogvlm_config"),
    "NevaForCausalLM": ("splitserve.loading.neva_nemo", "load_neva_config"),
    # the decoder's sizes at the top level (mBART names its encoder's num_hidden_layers)
    "vision-encoder-decoder": ("splitserve.models.nougat.model", "load_vision_encoder_decoder_config"),
    "nougat": ("splitserve.models.nougat.model", "load_vision_encoder_decoder_config"),
    # mBART's decoder alone: its num_attention_heads names the encoder's; the decoder's go to the top
    "mbart": ("splitserve.models.nougat.model", "load_mbart_config"),
}


def own_config_reader(model_type: str | None, architectures: list[str] | None = None):
    """The engine's reader for a remote-code model, or None."""
    for key in [model_type, *(architectures or [])]:
        if key in _CONFIG_READERS:
            module, name = _CONFIG_READERS[key]
            return getattr(importlib.import_module(module), name)
    return None


def config_reader(directory: str):
    """The reader (directory -> config) of a model directory whose family reads its own config, or None
    (loading/hf_config.read_hf_config reads it then)."""
    reader = own_config_reader(*config_model_type(directory))
    if reader is not None:
        return reader
    from splitserve.models.vila.config import is_vila_dir, load_vila_config
    return load_vila_config if is_vila_dir(directory) else None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


# (architecture, the text config's model_type) -> class, where one architecture name covers models
# the engine runs differently: BLIP-2 with Flan-T5 is an encoder-decoder, with OPT a decoder-only VLM.
_BY_TEXT_MODEL = {
    ("Blip2ForConditionalGeneration", "t5"): ("splitserve.models.blip2_t5.model", "Blip2T5ForConditionalGeneration"),
}


def get_model_class(architectures: list[str] | None, hf_config=None):
    """(architecture, model class); `hf_config` picks the variant of an architecture that has several."""
    text_type = getattr(getattr(hf_config, "text_config", None), "model_type", None)
    for arch in architectures or []:
        if arch in _MODELS:
            module, name = _BY_TEXT_MODEL.get((arch, text_type), _MODELS[arch])
            return arch, getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported model architecture {architectures}; supported: {', '.join(supported_architectures())}")
