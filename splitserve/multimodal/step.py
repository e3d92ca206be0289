"""The model runner's multimodal hook: the input embeddings of a step that contains image tokens.

For every scheduled request, the step computes tokens [start, start + n). Images whose placeholder
run overlaps that range need their features: those not in the encoder cache are encoded together,
in one batch through the vision tower and projector (the batchful stage), and the overlapping slice
of each image's features overwrites the token embeddings at its rows. A step without image tokens
returns None and runs exactly as a text step (so decode steps keep their CUDA graphs).

Encoding ahead (`prefetch`, after the step's forward is enqueued): the scheduler announces the
images of waiting requests once (`SchedulerOutput.mm_prefetch`, up to its encoder budget of image
tokens per step; a request arriving while others decode is admitted only a step after its
announcement, so its tower runs here rather than in the admitting step); up to PREFETCH_BATCH of them that
fit in the encoder cache's room are encoded per step, on a second CUDA stream, so the tower runs
beside the decoder's steps (mostly memory-bound decode steps, whose compute units idle) instead of
inside the step that admits them, and in larger batches. Their features enter the cache reserved
(never evicted before their request is admitted, or dropped when it ends while waiting); a step
that uses one waits for its stream's event first. On CPU the same happens synchronously.

It reads the worker's request states (worker/input_batch.py: `mm_items`, `num_computed_tokens`,
`is_active`), never the scheduler's requests.
"""
from __future__ import annotations

import torch

from collections import OrderedDict

from splitserve.multimodal.encoder_cache import EncoderCache

DEFAULT_ENCODER_CACHE_TOKENS = 16384
PREFETCH_BATCH = 64  # images per ahead-of-admission tower batch (large batches run the tower efficiently)


class MultiModalStepEncoder:
    def __init__(self, model, capacity_tokens: int = DEFAULT_ENCODER_CACHE_TOKENS):
        self.model = model
        self.cache = EncoderCache(capacity_tokens)
        self.num_images_encoded = 0  # images run through the tower (cache misses), for tests and stats
        self.num_images_prefetched = 0  # of which encoded ahead of their request's admission
        # Announced images not encoded yet: hash -> (request id, item), in announcement order.
        self.pending: OrderedDict[str, tuple[str, object]] = OrderedDict()
        self.announced: dict[str, list[str]] = {}  # request id -> hashes it announced (pending or reserved)
        self.ready: dict[str, torch.cuda.Event] = {}  # hash -> event of the side stream that encoded it
        device = next(model.parameters()).device
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def step_embeddings(self, spans, input_ids: torch.Tensor) -> torch.Tensor | None:
        """spans: (request state, start, n, first row in the flat batch) of the step's requests that
        compute tokens before the end of their last image run; the runner picks them vectorized."""
        # A model with per-token routing of its own (CogVLM's visual expert and RoPE shift) sets it
        # for the step's tokens; a step it routes runs the model's image path even where no image
        # feature lands in it (a chunk holding only the tokens before an image).
        prepare = self.model.prepare_step_tokens  # None where the model has none (ImagePromptHooks)
        routed = prepare is not None and prepare(spans, input_ids.shape[0])
        # (row in the flat batch, item, first feature, last feature + 1)
        slices = []
        for state, start, n, row in spans:
            self._collect(state, start, n, row, slices)
        if not slices:
            return self.model.embed(input_ids) if routed else None
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
                event = self.ready.pop(item.hash, None)
                if event is not None:  # encoded ahead on the side stream
                    stream = torch.cuda.current_stream()
                    stream.wait_event(event)
                    feats.record_stream(stream)  # its memory is not reused before this step has read it
                found[item.hash] = feats
        if missing:
            todo = list(missing.values())
            for item, feats in zip(todo, self._encode(todo)):
                found[item.hash] = feats
                self.cache.put(item.hash, feats)
            self.num_images_encoded += len(todo)
        return found


    def _encode(self, items) -> list[torch.Tensor]:
        """The tower over items in one batch; each image's features, checked against its placeholders."""
        feats = self.model.encode_images(items)
        for item, f in zip(items, feats):
            if f.shape[0] != item.num_tokens:
                raise RuntimeError(f"image encoder made {f.shape[0]} features for an image with "
                                   f"{item.num_tokens} placeholder tokens")
        return feats

    # -- encoding ahead of admission ---------------------------------------------------------------
    def forget(self, req_ids) -> None:
        """Requests that left (finished, or admitted: their images are then the step's business):
        their announced images are no longer pending, and their reservations go."""
        for rid in req_ids:
            for key in self.announced.pop(rid, ()):
                owner = self.pending.get(key)
                if owner is not None and owner[0] == rid:
                    del self.pending[key]
                self.cache.unreserve(key)

    def prefetch(self, sched) -> None:
        """Takes in a step message's announcements and removals, then encodes up to PREFETCH_BATCH
        pending images that fit in the cache's room (on the side stream on CUDA)."""
        self.forget(sched.finished_req_ids)
        self.forget([new.req_id for new in sched.new_requests if new.req_id in self.announced])
        for rid, items in sched.mm_prefetch.items():
            keys = self.announced.setdefault(rid, [])
            for item in items:
                keys.append(item.hash)
                if item.hash not in self.pending and item.hash not in self.cache:
                    self.pending[item.hash] = (rid, item)
        for key in [k for k in self.ready if k not in self.cache]:
            del self.ready[key]  # evicted after its reservation went: nobody can read it any more
        if not self.pending:
            return
        room = self.cache.room()
        todo = []
        for key, (_, item) in self.pending.items():
            if len(todo) == PREFETCH_BATCH or item.num_tokens > room:
                break
            todo.append(item)
            room -= item.num_tokens
        if not todo:
            return
        for item in todo:
            del self.pending[item.hash]
        if self.side_stream is None:
            feats = self._encode(todo)
            event = None
        else:
            # No wait on this step's stream: the inputs are copied on the side stream, the weights never
            # change, and waiting would put the tower after the step's forward instead of beside it.
            with torch.cuda.stream(self.side_stream):
                feats = self._encode(todo)
            event = torch.cuda.Event()
            event.record(self.side_stream)
        for item, f in zip(todo, feats):
            self.cache.put(item.hash, f, reserve=True)
            if event is not None:
                self.ready[item.hash] = event
        self.num_images_encoded += len(todo)
        self.num_images_prefetched += len(todo)
