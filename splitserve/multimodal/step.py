"""The model runner's multimodal hook: the input embeddings of a step that contains image tokens.

For every scheduled request, the step computes tokens [start, start + n). Images whose placeholder
run overlaps that range need their features: those not in the encoder cache are encoded together,
in one batch through the vision tower and projector (the batchful stage), and the overlapping slice
of each image's features overwrites the token embeddings at its rows. A step without image tokens
returns None and runs exactly as a text step (so decode steps keep their CUDA graphs).

It reads the worker's request states (worker/input_batch.py: `mm_items`, `num_computed_tokens`,
`is_active`), never the scheduler's requests.
"""
from __future__ import annotations

import torch

from splitserve.multimodal.encoder_cache import EncoderCache

DEFAULT_ENCODER_CACHE_TOKENS = 16384


class MultiModalStepEncoder:
    def __init__(self, model, capacity_tokens: int = DEFAULT_ENCODER_CACHE_TOKENS):
        self.model = model
        self.cache = EncoderCache(capacity_tokens)
        self.num_images_encoded = 0  # images run through the tower (cache misses), for tests and stats

    def step_embeddings(self, spans, input_ids: torch.Tensor) -> torch.Tensor | None:
        """spans: (request state, start, n, first row in the flat batch) of the step's requests that
        compute tokens before the end of their last image run; the runner picks them vectorized."""
        # A model with per-token data of its own (CogVLM's expert mask and RoPE shift) writes it
        # into its static buffers for the step's tokens.
        prepare = getattr(self.model, "prepare_step_tokens", None)
        if prepare is not None:
            prepare(spans, input_ids.shape[0])
        # (row in the flat batch, item, first feature, last feature + 1)
        slices = []
        for state, start, n, row in spans:
            self._collect(state, start, n, row, slices)
        if not slices:
            return None
        features = self._features([item for _, item, _, _ in slices])
        embeds = self.model.embed(input_ids)
        for dst, item, lo, hi in slices:
            embeds[dst:dst + hi - lo] = features[item.hash][lo:hi].to(embeds.dtype)
        return embeds

    def _collect(self, state, start: int, n: int, row: int, slices: list) -> None:
        stop = start + n
        for item in state.mm_items:
            if item.offset >= stop:
                break
            if item.end <= start:
                continue
            lo, hi = max(start, item.offset), min(stop, item.end)
            slices.append((row + lo - start, item, lo - item.offset, hi - item.offset))
            self.cache.pin(item.hash, state, item.end)

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

