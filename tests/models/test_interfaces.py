"""The model interface (models/interfaces.py): capabilities are computed from the protocols, once per
model, and a model that claims a capability without its methods is refused."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from splitserve.models.interfaces import (EncoderDecoder, ModelCapabilities, SupportsImageInput, SupportsPiecewise,
                                          TextModel, capabilities_of)
from splitserve.models.registry import get_model_class
from tests.multimodal_reference import vision_config

_TEXT = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6)


def _llava():
    from transformers import LlavaConfig
    config = LlavaConfig(text_config=_TEXT, vision_config=vision_config("clip"), image_token_index=5,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    _, cls = get_model_class(["LlavaForConditionalGeneration"], config)
    with torch.device("meta"):
        return cls(config)


def test_vlm_capabilities():
    model = _llava()
    caps = capabilities_of(model)
    assert isinstance(model, (TextModel, SupportsImageInput, SupportsPiecewise))
    assert not isinstance(model, EncoderDecoder)
    assert caps == ModelCapabilities(multimodal=True, encoder_decoder=False, decoder_images=True, own_processor=False,
                                     piecewise=True, lora=True, pipeline_stages=True, weight_reader=None)
    assert capabilities_of(model) is caps  # computed once per model
    # the optional hooks are explicit: None where the model has none
    assert model.preprocess_image is None and model.prepare_step_tokens is None and model.tokenize_prompt is None


def test_text_only_module_has_no_capabilities():
    caps = capabilities_of(nn.Module())
    assert not (caps.multimodal or caps.encoder_decoder or caps.piecewise or caps.lora or caps.pipeline_stages)


def test_claimed_capability_without_methods_is_refused():
    class Broken(nn.Module):
        is_multimodal = True

    class BrokenEncDec(nn.Module):
        is_encoder_decoder = True

    with pytest.raises(TypeError, match="SupportsImageInput"):
        capabilities_of(Broken())
    with pytest.raises(TypeError, match="encode"):
        capabilities_of(BrokenEncDec())
