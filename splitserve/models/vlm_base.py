"""The base class of the decoder-only vision-language models (LLaVA, VILA, Phi-3-vision, CogVLM,
BLIP-2 OPT, Fuyu, Kosmos-2, NeVA), and the front-side hooks every image-taking model may set.

`ImagePromptHooks` names every optional hook the front's processor (multimodal/processor.py) and the
runner's step encoder (multimodal/step.py) call, with its "not used" default: a model overrides the
ones it needs, and the callers read them as plain attributes instead of probing (models/interfaces.py
describes the interface, `SupportsImageInput`). It is a plain class so that image-taking models that
are not decoder-only VLMs (BLIP-2 with Flan-T5) carry the same defaults.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from splitserve.models.decoder import DecoderForCausalLM
from splitserve.multimodal.processor import IMAGE_MARKER, to_device_pixels


class ImagePromptHooks:
    """Optional hooks of an image-taking model, as class attributes; None: the processor's default."""

    is_multimodal: ClassVar[bool] = True
    is_encoder_decoder: ClassVar[bool] = False
    # The image token's text and id (None: the processor picks one; VILA and NeVA name none).
    image_token: ClassVar[str] = IMAGE_MARKER
    image_token_id: int | None = None
    image_processor_subfolder: ClassVar[str] = ""  # where the HF image processor's files are (VILA's part folder)
    # Videos (Video NeVA): the id marking one in token-id prompts, and the frames sampled from it.
    video_token_index: ClassVar[int | None] = None
    num_frames: int | None = None
    # BLIP-2 T5: the prompt's images sit in the encoder's input (read by the engine's front).
    encoder_prompt_has_images: ClassVar[bool] = False

    # Hooks (methods where a model has them, None where not):
    # directory -> image processor, for a model whose processor transformers lacks (remote code)
    load_image_processor: Callable[[str], Any] | None = None
    # (tokenizer, text, marker id) -> ids with one marker id per image: a model's own prompt format
    tokenize_prompt: Callable[[Any, str, int], list[int]] | None = None
    # (image processor, image) -> (pixel_values, image_size, num_tokens): more than pixel tiles (Fuyu)
    preprocess_image: Callable[[Any, Any], tuple[torch.Tensor, tuple[int, int], int]] | None = None
    # (text, num images, tokenizer) -> (text, add special tokens): the prompt text rewritten (Kosmos-2)
    format_prompt: Callable[[str, int, Any], tuple[str, bool]] | None = None
    # (ids, num images, marker id) -> ids: where images go in a prompt naming no place (BLIP-2, Fuyu)
    arrange_prompt: Callable[[list[int], int, int], list[int]] | None = None
    # (image, placeholder id) -> the run's ids, where it holds more than placeholders (Fuyu's row ends)
    image_run_ids: Callable[[Any, int], list[int]] | None = None
    # MultiModalPrompt -> None or raises: a model's own layout rules (CogVLM)
    check_mm_prompt: Callable[[Any], None] | None = None
    # (spans, total tokens) -> None: per-token data of the step written into the model's buffers (CogVLM)
    prepare_step_tokens: Callable[[Any, int], None] | None = None
    # generated text -> extra output fields (Kosmos-2's grounding) / Markdown post-processing (Nougat)
    postprocess_text: Callable[[str], dict] | None = None
    postprocess_markdown: Callable[[str], str | None] | None = None
    # () -> a processor class of its own, for prompts that are not placeholder runs (Pix2Struct, Nougat)
    mm_processor_class: Callable[[], type] | None = None


def build_language_model(text_config, quant_config=None, prefix: str = "model.language_model",
                         head_name: str = "lm_head") -> DecoderForCausalLM:
    """The decoder, of whichever family text_config's model_type names; a quantization config
    applies to it alone (the vision tower and projector stay in the model's dtype)."""
    return DecoderForCausalLM(text_config, quant_config, prefix, head_name)


class VisionLanguageModel(ImagePromptHooks, nn.Module):
    """The decoder-facing half shared by every VLM: the engine sees a causal LM with `layers`,
    `embed`, `forward(input_ids, positions, inputs_embeds)` and `compute_logits`."""

    language_model: DecoderForCausalLM

    @property
    def layers(self) -> nn.ModuleList:  # the runner compiles / graphs the decoder layers
        return self.language_model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed(input_ids)

    # The piecewise CUDA graphs (worker/cuda_graphs.py) run the decoder in segments: they need its
    # start (embeddings -> layer 0's stream), its final norm and its width.
    def start(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.language_model.start(x, positions)

    @property
    def norm(self) -> nn.Module:
        return self.language_model.norm

    @property
    def hidden_size(self) -> int:
        return self.language_model.spec.hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                intermediate=None):
        return self.language_model(input_ids, positions, inputs_embeds, intermediate)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, out)

    @property
    def _param(self) -> torch.Tensor:
        return self.language_model.embed_tokens.weight

    def encode_images(self, items) -> list[torch.Tensor]:
        """Every tile of the step's images in one batch through the model's `tile_features` ([N, 3, H, W]
        -> [N, tokens, text hidden]); each item's tiles' features, flat. Models that arrange tiles
        (LLaVA-NeXT's grid) override this."""
        feats = self.tile_features(to_device_pixels(items, self._param.device, self._param.dtype))
        return [f.reshape(-1, f.shape[-1]) for f in feats.split([it.pixel_values.shape[0] for it in items])]
