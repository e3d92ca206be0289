"""The model runner's multimodal hook: the input embeddings of a step that contains image tokens.

For every scheduled request, the step computes tokens [start, start + n). Images whose placeholder
run overlaps that range need their features: those not in the encoder cache are encoded together,
in one batch through the vision tower and projector (the batchful stage), and the overlapping slice
of each image's features overwrites the token embeddings at its rows. A step without image tokens
returns None and runs exactly as a text step (so decode steps keep their CUDA graphs).
"""
from __future__ import annotations

import torch

from splitserve.core.scheduler import SchedulerOutput
from splitserve.multimodal.encoder_cache import EncoderCache
from splitserve.request import Request

DEFAULT_ENCODER_CACHE_TOKENS = 16384


class MultiModalStepEncoder:
    def __init__(self, model, capacity_tokens: int = DEFAULT_ENCODER_CACHE_TOKENS):
        self.model = model
        self.cache = EncoderCache(capacity_tokens)
        self.num_images_encoded = 0  # images run through the tower (cache misses), for tests and stats

    def step_embeddings(self, sched: SchedulerOutput, input_ids: torch.Tensor) -> torch.Tensor | None:
        # (row in the flat batch, item, first feature, last feature + 1)
        slices = []
        row = 0
        for request, n in sched.scheduled:
            items = request.mm_items
            if items and request.num_computed_tokens < items[-1].end:
                self._collect(request, n, row, slices)
            row += n
        if not slices:
            return None
        features = self._features([item for _, item, _, _ in slices])
        embeds = self.model.embed(input_ids)
        for dst, item, lo, hi in slices:
            embeds[dst:dst + hi - lo] = features[item.hash][lo:hi].to(embeds.dtype)
        return embeds

    def _collect(self, request: Request, n: int, row: int, slices: list) -> None:
        start = request.num_computed_tokens
        stop = start + n
        for item in request.mm_items:
            if item.offset >= stop:
                break
            if item.end <= start:
                continue
            lo, hi = max(start, item.offset), min(stop, item.end)
            slices.append((row + lo - start, item, lo - item.offset, hi - item.offset))
            self.cache.pin(item.hash, request, item.end)

    def _features(self, items) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        missing = {}
        for item in items:
            if item.hash in found or item.hash in missing:
                continue
            feats = self.cache.get(item.hash)
            if feats is None:
                missing[item.hash] = item
            else:
                found[item.hash] = feats
        if missing:
            todo = list(missing.values())
            for item, feats in zip(todo, self.model.encode_images(todo)):
                if feats.shape[0] != item.num_tokens:
                    raise RuntimeError(f"image encoder made {feats.shape[0]} features for an image with "
                                       f"{item.num_tokens} placeholder tokens")
                found[item.hash] = feats
                self.cache.put(item.hash, feats)
            self.num_images_encoded += len(todo)
        return found


def block_extra_keys(request: Request, start: int, end: int) -> tuple:
    """Hashes of the images whose placeholders overlap tokens [start, end) of the request: they enter
    the KV block hash, so a cached block is reused only for the same image."""
    return tuple(item.hash for item in request.mm_items if item.offset < end and item.end > start)
