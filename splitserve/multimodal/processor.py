"""From user input to a `MultiModalPrompt`: images -> pixels (the model's HF image processor),
image markers in the prompt -> runs of placeholder tokens, chat content parts -> template text.

The marker is `<image>` in text. Where the tokenizer knows it as one token (llava-hf checkpoints
add it), the text is tokenized whole and that token marks each image; otherwise (VILA) the text is
split at the markers and the pieces are tokenized separately, as VILA's own front end does. In
token-id prompts an image is marked by the model's image token id (VILA: -200, its IMAGE_TOKEN_INDEX).
Each marker becomes as many placeholder tokens as the model makes features for that image.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

from splitserve.protocol.mm_inputs import ImageItem, MultiModalPrompt, ProcessedImage, image_hash
from splitserve.multimodal.media import MediaError, MediaPolicy, load_image
from splitserve.multimodal.tensor_preprocess import tensor_processor_for
from splitserve.multimodal.video import DecodedVideo, VideoRef, load_video

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<image>"
IMAGE_PART_TYPES = ("image_url", "input_image", "image", "image_pil")
VILA_IMAGE_TOKEN_INDEX = -200
# Videos (models with `video_token_index`: Video NeVA): `<video>` in text, that id in token-id prompts.
VIDEO_MARKER = "<video>"
VIDEO_PART_TYPES = ("video_url", "video")


def load_image_processor(directory: str):
    """The checkpoint's HF image processor, PIL/numpy flavour: no torchvision needed, and it is the
    flavour the models were trained with. transformers 5 names it a backend, 4.x `use_fast=False`."""
    import transformers
    from transformers import AutoImageProcessor
    major = int(transformers.__version__.split(".")[0])
    kwargs = {"backend": "pil"} if major >= 5 else {"use_fast": False}
    return AutoImageProcessor.from_pretrained(directory, **kwargs)


class MultiModalProcessor:
    """The front-side processor of a model that takes images through placeholder runs. `model` is a
    SupportsImageInput (models/interfaces.py; a weightless copy will do): its optional hooks are
    attributes that are None where the model has none (models/vlm_base.ImagePromptHooks), read here
    as they are."""

    def __init__(self, model, model_directory: str, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        folder = os.path.join(model_directory, model.image_processor_subfolder)
        # A model whose processor transformers lacks (remote code: Phi-3-vision) brings its own.
        own_processor = model.load_image_processor
        self.image_processor = own_processor(folder) if own_processor else load_image_processor(folder)
        # A model's own prompt format (Phi-3-vision's <|image_N|>): text -> ids with one marker id per image.
        self.tokenize_prompt = model.tokenize_prompt
        marker = model.image_token  # the placeholder's token text
        marker_id = tokenizer.convert_tokens_to_ids(marker) if tokenizer is not None else None
        unk = getattr(tokenizer, "unk_token_id", None)
        if marker_id == unk:
            marker_id = None
        # VILA names no image token: use the tokenizer's <image> if it has one; any id would do, as
        # the embeddings at placeholders are replaced (the image hash keeps KV blocks apart).
        placeholder = model.image_token_id
        self.placeholder_id = placeholder if placeholder is not None else (marker_id if marker_id is not None else 0)
        # The marker is one token only if the tokenizer maps it to the model's image token.
        self.marker_is_token = marker_id is not None and marker_id == self.placeholder_id
        # Ids that mark an image in a token-id prompt.
        self.marker_ids = {self.placeholder_id, VILA_IMAGE_TOKEN_INDEX}
        # Whether the placeholder is a token of its own (not a stand-in such as VILA's token 0): a
        # token-id prompt that holds it without an image is refused (check_token_ids).
        self.placeholder_is_dedicated = placeholder is not None or self.marker_is_token
        # Videos: the id that marks one (None: the model takes none) and the frames sampled from it.
        self.video_marker_id = model.video_token_index
        self.num_frames = model.num_frames
        self.max_model_len: int | None = None  # set by the engine's front: a video too long is a 400

    # -- images ----------------------------------------------------------------------------------
    def set_preprocess_device(self, device) -> None:
        """Preprocess with tensor ops on `device` (multimodal/tensor_preprocess.py) where this model's
        image processor has a tensor version; the HF processor stays otherwise."""
        fast = tensor_processor_for(self.image_processor, device)
        if fast is not None:
            self.image_processor = fast

    def process_image(self, img) -> ProcessedImage:
        # Hook: a model whose image processor gives more than pixel tiles (Fuyu's patch grids) turns
        # one image into (pixel_values, image_size, num_tokens) itself.
        custom = self.model.preprocess_image
        if custom is not None:
            pixels, size, n = custom(self.image_processor, img)
            return ProcessedImage(image_hash(img), pixels.contiguous(), size, n)
        out = self.image_processor(images=[img], return_tensors="pt")
        pixels = out["pixel_values"]
        pixels = pixels[0] if pixels.dim() == 5 else pixels  # anyres: [1, tiles, 3, H, W]
        sizes = out.get("image_sizes")
        size = tuple(int(v) for v in sizes[0]) if sizes is not None else (img.size[1], img.size[0])
        n = self.model.num_image_tokens(pixels.shape[0], size)
        return ProcessedImage(image_hash(img), pixels.contiguous(), size, n)

    def process_video(self, video: DecodedVideo) -> ProcessedImage:
        """A video's sampled frames as one item: the frames are its tiles, their runs back to back."""
        if self.video_marker_id is None:
            raise MediaError(f"model {type(self.model).__name__} does not accept videos")
        pixels = torch.cat([self.process_image(f).pixel_values for f in video.frames])
        n = self.model.num_video_tokens(len(video.frames))
        if self.max_model_len is not None and n >= self.max_model_len:
            raise MediaError(f"a video of {len(video.frames)} frames takes {n} tokens, but the model's context is "
                             f"{self.max_model_len} tokens (max_model_len); lower --num-frames")
        size = (video.frames[0].size[1], video.frames[0].size[0])
        return ProcessedImage(video.hash, pixels.contiguous(), size, n, {"kind": "video"})

    def process_media(self, media) -> ProcessedImage:
        """A decoded image (PIL) or video (DecodedVideo)."""
        return self.process_video(media) if isinstance(media, DecodedVideo) else self.process_image(media)

    def load_media(self, source, policy: MediaPolicy):
        """An image source -> PIL image; a VideoRef -> DecodedVideo (refused for a model without video)."""
        if isinstance(source, VideoRef):
            if self.video_marker_id is None:
                raise MediaError(f"model {type(self.model).__name__} does not accept videos")
            return load_video(source, policy, self.num_frames)
        return load_image(source, policy)

    def load_and_process(self, sources: list, policy: MediaPolicy) -> list[ProcessedImage]:
        return [self.process_media(self.load_media(s, policy)) for s in sources]

    def check_token_ids(self, ids: list[int]) -> None:
        """A token-id prompt without images or videos must not hold a marker: its placeholder run
        would get no features (the embeddings of the marker token itself would be read instead)."""
        markers = ({self.placeholder_id} if self.placeholder_is_dedicated else set()) | \
            ({self.video_marker_id} if self.video_marker_id is not None else set())
        found = sorted(markers.intersection(ids))
        if found:
            raise MediaError(f"the prompt holds image/video placeholder token id(s) {found} but no image or video "
                             f"was given (pass multi_modal_data, or image_url/video_url content parts)")

    # -- prompts ---------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text with `<image>` markers -> ids with one marker id per image. Rendered chat templates
        carry their own BOS, so they are tokenized without special tokens."""
        if self.tokenize_prompt is not None:
            return self.tokenize_prompt(self.tokenizer, text, self.placeholder_id)
        if self.marker_is_token or IMAGE_MARKER not in text:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ids: list[int] = []
        for i, piece in enumerate(text.split(IMAGE_MARKER)):
            if i:
                ids.append(VILA_IMAGE_TOKEN_INDEX)
            if piece or i == 0:
                ids.extend(self.tokenizer.encode(piece, add_special_tokens=add_special_tokens and i == 0))
        return ids

    def text_prompt_ids(self, text: str) -> list[int]:
        """A text prompt without images, as the model's own processor would tokenize it."""
        format_text = self.model.format_prompt
        if format_text is None:
            return list(self.tokenizer.encode(text, add_special_tokens=True))
        text, special = format_text(text, 0, self.tokenizer)
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def build_prompt(self, prompt: str | list[int], images: list[ProcessedImage]) -> MultiModalPrompt:
        """Expands each image marker of the prompt into the image's placeholder tokens."""
        format_text = self.model.format_prompt
        if isinstance(prompt, str) and format_text is not None:
            # Hook: a model whose processor rewrites the prompt text (Kosmos-2: BOS and the image
            # markers written out, no EOS) says how, and whether to add special tokens after it.
            prompt, special = format_text(prompt, len(images), self.tokenizer)
            ids = self.tokenize(prompt, add_special_tokens=special)
        else:
            ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        video_id = self.video_marker_id
        marks = [i for i, t in enumerate(ids) if t in self.marker_ids or (video_id is not None and t == video_id)]
        arrange = self.model.arrange_prompt
        if not marks and images and arrange is not None:
            # Hook: where a model's own processor puts images in a prompt that names no place for
            # them (BLIP-2, Fuyu: first); returns the ids with one marker id per image.
            ids = arrange(ids, len(images), self.placeholder_id)
            marks = [i for i, t in enumerate(ids) if t in self.marker_ids]
        # Image markers take the images in order, video markers the videos.
        videos = [m for m in images if m.extra.get("kind") == "video"]
        stills = [m for m in images if m.extra.get("kind") != "video"]
        n_video_marks = sum(1 for i in marks if video_id is not None and ids[i] == video_id)
        if len(marks) - n_video_marks != len(stills) or n_video_marks != len(videos):
            what = f"{len(marks) - n_video_marks} image placeholder(s) ({IMAGE_MARKER})"
            given = f"{len(stills)} image(s)"
            if video_id is not None:
                what += f" and {n_video_marks} video placeholder(s) ({VIDEO_MARKER})"
                given += f" and {len(videos)} video(s)"
            raise MediaError(f"the prompt has {what} but {given} were given")
        queues = {True: iter(videos), False: iter(stills)}
        ordered = [next(queues[video_id is not None and ids[i] == video_id]) for i in marks]
        out: list[int] = []
        items: list[ImageItem] = []
        prev = 0
        for pos, img in zip(marks, ordered):
            out.extend(ids[prev:pos])
            items.append(ImageItem(img.hash, img.pixel_values, img.image_size, img.num_tokens, len(out)))
            # Hook: a model whose image run holds other tokens than its placeholder (Fuyu's row ends)
            # gives the run's ids; the embeddings at every position of the run are still the model's.
            run = self.model.image_run_ids
            out.extend(run(img, self.placeholder_id) if run is not None else [self.placeholder_id] * img.num_tokens)
            prev = pos + 1
        out.extend(ids[prev:])
        prompt = MultiModalPrompt(out, items)
        check = self.model.check_mm_prompt  # a model's own layout rules (CogVLM)
        if check is not None:
            check(prompt)
        return prompt

    # -- chat ------------------------------------------------------------------------------------
    @staticmethod
    def split_chat(messages: list[dict]) -> tuple[list[dict], list[Any]]:
        """Chat messages with image content parts -> messages with plain-text content (each image
        part becomes the marker where it stood) and the image sources in order."""
        converted, sources = [], []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    kind = part.get("type")
                    if kind == "text":
                        texts.append(part.get("text") or "")
                    elif kind in IMAGE_PART_TYPES:
                        sources.append(image_part_source(part))
                        texts.append(IMAGE_MARKER)
                    elif kind in VIDEO_PART_TYPES:
                        sources.append(VideoRef(video_part_source(part)))
                        texts.append(VIDEO_MARKER)
                    else:
                        raise MediaError(f"unsupported content part type {kind!r}")
                content = "\n".join(texts)
            converted.append({**m, "content": content if content is not None else ""})
        return converted, sources

    def check_count(self, n: int, policy: MediaPolicy) -> None:
        if policy.limit_per_prompt is not None and n > policy.limit_per_prompt:
            raise MediaError(f"too many images: {n} given, at most {policy.limit_per_prompt} per request "
                             f"(--limit-mm-per-prompt)")

    def chat_prompt_from_text(self, text: str, images: list[ProcessedImage]) -> MultiModalPrompt:
        """A rendered chat template (markers as text) + its processed images."""
        return self.build_prompt(self.tokenize(text, add_special_tokens=False), images)

    def chat_prompt(self, messages: list[dict], render_text: Callable[[list[dict]], str],
                    policy: MediaPolicy) -> MultiModalPrompt:
        """Offline chat: messages with image parts -> prompt. render_text applies the chat template
        without tokenizing."""
        converted, sources = self.split_chat(messages)
        self.check_count(len(sources), policy)
        images = self.load_and_process(sources, policy)
        return self.chat_prompt_from_text(render_text(converted), images)


def image_part_source(part: dict):
    """The image of one content part: OpenAI's {"type": "image_url", "image_url": {"url"}} or
    {"image_url": "..."}, or the offline {"type": "image", "image": <PIL|path|URL>}."""
    for key in ("image_url", "image", "image_pil", "url"):
        if key in part and part[key] is not None:
            value = part[key]
            return value.get("url") if isinstance(value, dict) else value
    raise MediaError("image content part has no image (expected image_url.url)")


def video_part_source(part: dict):
    """vLLM's {"type": "video_url", "video_url": {"url": ...}}, or the offline {"type": "video", "video": ...}."""
    for key in ("video_url", "video", "url"):
        if key in part and part[key] is not None:
            value = part[key]
            return value.get("url") if isinstance(value, dict) else value
    raise MediaError("video content part has no video (expected video_url.url)")


def has_images(messages: list[dict]) -> bool:
    """Whether any message has an image or video part."""
    return any(isinstance(m.get("content"), list) and
               any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES + VIDEO_PART_TYPES for p in m["content"])
               for m in messages)


def to_device_pixels(items: list[ImageItem], device, dtype) -> torch.Tensor:
    return torch.cat([it.pixel_values for it in items]).to(device=device, dtype=dtype, non_blocking=True)


# -- offline API (LLM.generate / LLM.chat) -----------------------------------------------------------
def offline_prompt(engine, prompt: dict) -> MultiModalPrompt:
    """{"prompt" | "prompt_token_ids": ..., "multi_modal_data": {"image": img | [imgs]}} -> prompt.
    Images may be PIL images, paths, or data:/file:// URLs."""
    mm = engine.mm_processor
    if mm is None:
        raise ValueError(f"model {engine.model_name} does not accept images")
    data = prompt["multi_modal_data"] or {}
    unknown = set(data) - {"image", "video"}
    if unknown:
        raise ValueError(f"unsupported multi_modal_data keys {sorted(unknown)}; 'image' and 'video' are supported")
    images = data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    # One video: a path / bytes / URL, or its frames ([T, H, W, 3] array, or a list of frames);
    # several: a list of those (a list whose items are all frames is one video).
    videos = data.get("video", [])
    if _is_one_video(videos):
        videos = [videos]
    text = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    sources = images + [VideoRef(v) for v in videos]
    return mm.build_prompt(text, mm.load_and_process(sources, MediaPolicy.offline()))


def _is_one_video(value) -> bool:
    if not isinstance(value, (list, tuple)):
        return True
    return bool(value) and all(_is_frame(f) for f in value)


def _is_frame(value) -> bool:
    from PIL import Image
    return isinstance(value, Image.Image) or getattr(value, "ndim", None) == 3


def offline_chat_prompt(llm, messages: list[dict], add_generation_prompt: bool, **kwargs):
    """LLM.chat for one conversation: plain template ids without images, a MultiModalPrompt with."""
    if not has_images(messages):
        return llm.apply_chat_template(messages, add_generation_prompt, **kwargs)
    mm = llm.engine.mm_processor
    if mm is None:
        raise ValueError(f"model {llm.engine.model_name} does not accept images")

    def render_text(converted: list[dict]) -> str:
        return llm.tokenizer.apply_chat_template(converted, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **kwargs)
    return mm.chat_prompt(messages, render_text, MediaPolicy.offline())
