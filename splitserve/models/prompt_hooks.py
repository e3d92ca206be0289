"""The front-side half of an image-taking model: every optional hook the front's processor
(multimodal/processor.py) and the runner's step encoder (multimodal/step.py) call, with its "not
used" default. A model's processor class (models/<name>/processor.py) derives from ImagePromptHooks,
overrides the hooks it needs and sets its state from the config alone in `init_processing`; the model
class derives from it too and calls `init_processing` in its constructor. So the hooks are read as
plain attributes instead of being probed (models/interfaces.py, `SupportsImageInput`), and a
processor class is built from a config without importing model code (`from_config`).

Nothing here or in a processor module imports layers/ or the model modules: only config, tensors and
multimodal/'s helpers.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from splitserve.multimodal.processor import IMAGE_MARKER


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
    # (spans, total tokens) -> whether the step is routed: per-token data of the step set on the model
    # (CogVLM's visual-expert rows and RoPE shifts); a routed step runs the model's image path
    prepare_step_tokens: Callable[[Any, int], bool] | None = None
    # Steps with image tokens run eagerly, off the piecewise CUDA graphs (CogVLM: its routed layers
    # change shapes with each step's image rows); steps without them still replay graphs.
    image_steps_eager: ClassVar[bool] = False
    # generated text -> extra output fields (Kosmos-2's grounding) / Markdown post-processing (Nougat)
    postprocess_text: Callable[[str], dict] | None = None
    postprocess_markdown: Callable[[str], str | None] | None = None
    # () -> a processor class of its own, for prompts that are not placeholder runs (Pix2Struct, Nougat)
    mm_processor_class: Callable[[], type] | None = None

    def init_processing(self, config) -> None:
        """Sets the front-side state (token ids, counts) from the config; a model calls it in __init__."""

    @classmethod
    def from_config(cls, config):
        """The hooks alone, without a model (no nn.Module state): what the front's processor reads."""
        obj = cls.__new__(cls)
        obj.init_processing(config)
        return obj


def tower_tokens(vision_config, class_token: bool | None = None) -> int:
    """Tokens a CLIP / SigLIP tower (layers/vision.VisionTower) outputs per tile: its patches, plus the
    class token (CLIP's; `class_token` overrides the model_type rule as VisionTower's does)."""
    is_clip = vision_config.model_type in ("clip_vision_model", "clip") if class_token is None else class_token
    return (vision_config.image_size // vision_config.patch_size) ** 2 + int(is_clip)
