"""Continuous batching under a per-step token budget.

Each step decides one number per request: how many of its not-yet-computed tokens run now. Prefill,
chunked prefill and decode are the same thing with different counts. Running requests go first (so
decodes are never starved by new prompts), then waiting ones are admitted while the budget, the
sequence cap and the KV blocks allow. When blocks run out, the most recently admitted running request
is preempted: its blocks are freed and it is recomputed later from its tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    # Requests run this step, in batch order, with their number of new tokens.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    total_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager):
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- admission -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n <= 0 or (request.num_pending and self._at_length_limit(request)):
                # Nothing to compute, or its last token is still in flight and ends it: skip.
                i += 1
                continue
            while not self.kv.allocate_slots(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, n))
                scheduled_ids.add(request.request_id)
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: it was the last running one

        # New work only when nothing had to give way this step.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            hits, num_cached = self.kv.get_computed_blocks(request)
            n = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, n, hits):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            self.running.append(request)
            out.scheduled.append((request, n))
            budget -= n

        out.total_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    @staticmethod
    def _at_length_limit(request: Request) -> bool:
        max_tokens = request.sampling_params.max_tokens
        return (max_tokens is not None and request.num_output_tokens >= max_tokens) or \
            request.num_tokens >= request.max_total_tokens

    # -- results ---------------------------------------------------------------------------------
    def advance(self, out: SchedulerOutput, sample_requests: list[Request]) -> None:
        """Once a step is launched: its tokens count as computed, and each request that samples
        holds one pending token until the step's results arrive (update)."""
        for request, n in out.scheduled:
            request.num_computed_tokens += n
        for row, request in enumerate(sample_requests):
            request.num_pending += 1
            request.sample_row = row

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """With a step's results: turns the pending tokens of its sampling requests into output
        tokens, applies token-level stop rules and caches filled blocks. Returns the requests that got
        a new token (finished ones included)."""
        updated = []
        for request, n in out.scheduled:
            if request.is_finished:  # aborted (or failed) while the step ran
                continue
            token = sampled.get(request.request_id)
            if token is not None:
                request.num_pending -= 1
                request.output_token_ids.append(token)
                self._check_stop(request, token)
                updated.append(request)
            if request.status == RequestStatus.RUNNING:  # a preempted request has no blocks to cache
                self.kv.cache_full_blocks(request)
            if request.is_finished:
                self._release(request)
        return updated

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return
        if (params.max_tokens is not None and num_out >= params.max_tokens) or \
                request.num_known_tokens >= request.max_total_tokens:
            request.status = RequestStatus.FINISHED_LENGTH

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Ends requests (abort, stop string, error) wherever they are; unknown ids are ignored."""
        done = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.WAITING:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            done.append(request)
        return done

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:  # preempted while its last step ran, then finished by its result
            self.waiting.remove(request)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
