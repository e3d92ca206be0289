"""Encoder outputs (projected image features) by image hash: bounded, least-recently-used, and never
evicting an entry that a running request still needs.

A request needs an image until its computed tokens pass the image's placeholder run: with chunked
prefill the run can span steps, and the features must still be there for the later chunks. The
cache remembers, per entry, the requests that use it and where their run ends; a user stops
counting once it has computed past that point, finished, or been preempted (it is re-pinned when it
runs again). If every entry is needed, the cache grows past its bound rather than failing a step;
it shrinks back as users move on.

An entry encoded ahead of its request's admission (multimodal/step.py's prefetch) is *reserved*:
kept like a pinned one until its request pins it (admitted) or the reservation is dropped (the
request ended while waiting).

A user is the worker's state of a request (worker/input_batch.py), read through three attributes:
`req_id`, `is_active` (in the running batch: not finished, not preempted) and `num_computed_tokens`.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        if capacity_tokens < 1:
            raise ValueError(f"encoder cache capacity must be >= 1 token, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # LRU first
        self._users: dict[str, dict[str, tuple[object, int]]] = {}     # hash -> request id -> (user, end)
        self._reserved: set[str] = set()  # encoded ahead, its request not admitted yet
        self.num_tokens = 0
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor | None:
        feats = self._entries.get(key)
        if feats is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return feats

    def put(self, key: str, feats: torch.Tensor, reserve: bool = False) -> None:
        if reserve:
            self._reserved.add(key)
        if key in self._entries:
            return
        self._entries[key] = feats
        self.num_tokens += feats.shape[0]
        self._evict()

    def pin(self, key: str, user, end: int) -> None:
        """Marks key as needed by a request (its worker state) until it has computed `end` tokens."""
        self._users.setdefault(key, {})[user.req_id] = (user, end)
        self._reserved.discard(key)

    def unreserve(self, key: str) -> None:
        self._reserved.discard(key)

    def room(self) -> int:
        """Tokens that entries could still take without going over the bound or evicting an entry
        that is needed (pinned or reserved)."""
        return self.capacity_tokens - sum(f.shape[0] for k, f in self._entries.items() if self._still_needed(k))

    def _still_needed(self, key: str) -> bool:
        if key in self._reserved:
            return True
        users = self._users.get(key)
        if not users:
            return False
        for rid, (user, end) in list(users.items()):
            if not user.is_active or user.num_computed_tokens >= end:
                del users[rid]
        if not users:
            del self._users[key]
            return False
        return True

    def _evict(self) -> None:
        if self.num_tokens <= self.capacity_tokens:
            return
        for key in list(self._entries):
            if self.num_tokens <= self.capacity_tokens:
                break
            if self._still_needed(key):
                continue
            self.num_tokens -= self._entries.pop(key).shape[0]

    def num_pinned(self) -> int:
        """Entries some running request still needs (drops users that have moved on)."""
        return sum(1 for key in list(self._users) if self._still_needed(key))

    def is_whole(self) -> bool:
        """Nothing pinned, and (after trimming what went over the bound while pinned) within its
        bound, with the token count matching the entries: what a drained engine must show."""
        self._evict()
        return self.num_pinned() == 0 and not self._users and not self._reserved and self.num_tokens <= self.capacity_tokens \
            and self.num_tokens == sum(f.shape[0] for f in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()
        self._users.clear()
        self._reserved.clear()
        self.num_tokens = 0
