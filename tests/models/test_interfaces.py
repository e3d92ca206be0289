"""The model interface (models/interfaces.py): capabilities are computed from the protocols, once per
model, and a model that claims a capability without its methods is refused."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from splitserve.models.interfaces import (EncoderDecoder, ModelCapabilities, SupportsImageInput, SupportsImagePrompts,
                                          SupportsPiecewise, TextModel, _compute, capabilities_of, satisfies)
from splitserve.models.registry import get_model_class, get_processor_class
from tests.multimodal_reference import vision_config

_TEXT = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6)


def _llava_config(anyres: bool = False):
    from transformers import LlavaConfig, LlavaNextConfig
    if anyres:
        return LlavaNextConfig(text_config=_TEXT, vision_config=vision_config("clip"), image_token_index=5,
                               vision_feature_layer=-2, vision_feature_select_strategy="default",
                               image_grid_pinpoints=[[56, 112], [112, 56], [112, 112]])
    return LlavaConfig(text_config=_TEXT, vision_config=vision_config("clip"), image_token_index=5,
                       vision_feature_layer=-2, vision_feature_select_strategy="default")


def _llava(anyres: bool = False):
    config = _llava_config(anyres)
    config.architectures = [("LlavaNext" if anyres else "Llava") + "ForConditionalGeneration"]
    _, cls = get_model_class(config.architectures, config)
    with torch.device("meta"):
        return cls(config)


def test_vlm_capabilities():
    model = _llava()
    caps = capabilities_of(model)
    assert all(satisfies(model, p) for p in (TextModel, SupportsImagePrompts, SupportsImageInput, SupportsPiecewise))
    assert not satisfies(model, EncoderDecoder)
    assert caps == ModelCapabilities(multimodal=True, encoder_decoder=False, decoder_images=True, own_processor=False,
                                     piecewise=True, lora=True, pipeline_stages=True, weight_reader=None)
    assert capabilities_of(model) is caps  # computed once per model
    # the optional hooks are explicit: None where the model has none
    assert model.preprocess_image is None and model.prepare_step_tokens is None and model.tokenize_prompt is None


def test_capabilities_see_submodules_and_compiled_layers():
    """A decoder's `layers` is a submodule and a compiled layer forwards its methods, both found through
    __getattr__, which inspect.getattr_static (Python 3.12's isinstance on a Protocol) does not call:
    with isinstance the text decoder lost piecewise graphs on the GPU image's Python 3.12."""
    import inspect
    config = _llama_config()
    _, cls = get_model_class(["LlamaForCausalLM"], config)
    with torch.device("meta"):
        model = cls(config)
    model.layers[0] = torch.compile(model.layers[0])  # as worker/model_runner.compile_decoder_layers does
    assert inspect.getattr_static(model, "layers", None) is None  # the lookup that missed them
    assert inspect.getattr_static(model.layers[0], "attn_inputs", None) is None
    caps = _compute(model)
    assert caps.piecewise and caps.lora and not caps.multimodal


def _llama_config():
    from transformers import LlamaConfig
    config = LlamaConfig(**{k: v for k, v in _TEXT.items() if k != "model_type"})
    config.architectures = ["LlamaForCausalLM"]
    return config


def test_text_only_module_has_no_capabilities():
    caps = capabilities_of(nn.Module())
    assert not (caps.multimodal or caps.encoder_decoder or caps.piecewise or caps.lora or caps.pipeline_stages)


def test_claimed_capability_without_methods_is_refused():
    class Broken(nn.Module):
        is_multimodal = True

    class BrokenEncDec(nn.Module):
        is_encoder_decoder = True

    with pytest.raises(TypeError, match="SupportsImagePrompts"):
        capabilities_of(Broken())
    with pytest.raises(TypeError, match="encode"):
        capabilities_of(BrokenEncDec())


def test_blip2_t5_takes_image_prompts_not_decoder_images():
    """BLIP-2 with Flan-T5: its images go to the encoder, so it needs the front's side only."""
    from transformers import Blip2Config
    config = Blip2Config(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, image_size=28, patch_size=14),
                         qformer_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                             intermediate_size=64, encoder_hidden_size=32),
                         text_config=dict(model_type="t5", d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                          num_decoder_layers=1, num_heads=4, vocab_size=64),
                         num_query_tokens=4, image_token_index=3)
    _, cls = get_model_class(["Blip2ForConditionalGeneration"], config)
    with torch.device("meta"):
        model = cls(config)
    caps = capabilities_of(model)
    assert caps.multimodal and caps.encoder_decoder and not caps.decoder_images and not caps.own_processor
    assert isinstance(model, SupportsImagePrompts) and isinstance(model, EncoderDecoder)


@pytest.mark.parametrize("anyres", [False, True])
def test_processor_from_config_matches_the_model(anyres):
    """The front's hooks built from the config alone count an image's tokens as the model does."""
    config = _llava_config(anyres)
    model = _llava(anyres)
    hooks = get_processor_class(model.config.architectures).from_config(config)
    assert not isinstance(hooks, nn.Module)
    assert hooks.image_token_id == model.image_token_id == 5
    for tiles, size in [(1, (56, 56)), (3, (56, 112)), (5, (100, 90))]:
        if not anyres and tiles > 1:
            continue
        assert hooks.num_image_tokens(tiles, size) == model.num_image_tokens(tiles, size)


def test_processors_import_no_model_code():
    """The front imports processors (and config readers) without the model modules or layers/."""
    import subprocess
    import sys
    code = ("import importlib, sys\n"
            "from splitserve.models.registry import _PROCESSORS\n"
            "for m, _ in _PROCESSORS.values(): importlib.import_module(m)\n"
            "for m in ('phi3v', 'cogvlm', 'vila'): importlib.import_module(f'splitserve.models.{m}.config')\n"
            "bad = [k for k in sys.modules if k.startswith(('splitserve.layers', 'splitserve.attention',\n"
            "       'splitserve.models.vlm_base', 'splitserve.models.decoder'))\n"
            "       or (k.startswith('splitserve.models.') and k.endswith('.model'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
