"""What a multimodal request carries from the front end to the model runner."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One preprocessed image of a prompt and where its placeholder tokens sit.

    `offset`..`end` is a run of `num_tokens` placeholder positions in the prompt; the model's image
    features (exactly num_tokens vectors) replace the token embeddings there.
    """
    hash: str                  # content hash of the decoded pixels: the encoder-cache and KV-hash key
    pixel_values: torch.Tensor  # [tiles, 3, H, W] from the model's HF image processor (tiles = 1 except anyres)
    image_size: tuple[int, int]  # original (height, width), for any-resolution unpadding
    num_tokens: int
    offset: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def at(self, offset: int) -> "ImageItem":
        return ImageItem(self.hash, self.pixel_values, self.image_size, self.num_tokens, offset)


class MultiModalPrompt(list):
    """Prompt token ids (placeholders already expanded) plus the images they stand for.

    A list of ints so that it flows unchanged through every layer that passes token-id prompts
    along (the async engine's queue, validation); the engine reads `mm_items` when it builds the
    request. Items are sorted by offset and do not overlap.
    """

    def __init__(self, token_ids, mm_items: list[ImageItem] | tuple[ImageItem, ...] = ()):
        super().__init__(token_ids)
        self.mm_items: tuple[ImageItem, ...] = tuple(sorted(mm_items, key=lambda it: it.offset))

    def __reduce__(self):  # keep the items when copied or pickled
        return (MultiModalPrompt, (list(self), self.mm_items))


@dataclass
class ProcessedImage:
    """An image after loading and preprocessing, before its place in a prompt is known."""
    hash: str
    pixel_values: torch.Tensor
    image_size: tuple[int, int]
    num_tokens: int = 0
    extra: dict = field(default_factory=dict)


def image_hash(img) -> str:
    """Content hash of decoded pixels: the same picture sent as PNG, JPEG-free data URL or path hashes
    the same, and a one-pixel change does not."""
    h = hashlib.sha256()
    h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()
