"""Continuous batching under a per-step token budget.

Each step decides one number per request: how many of its not-yet-computed tokens run now. Prefill,
chunked prefill and decode are the same thing with different counts. Running requests go first (so
decodes are never starved by new prompts), then waiting ones are admitted while the budget, the
sequence cap and the KV blocks allow. When blocks run out, the most recently admitted running request
is preempted: its blocks are freed and it is recomputed later from its tokens. Under the priority
policy (`--scheduling-policy priority`, vLLM's) the waiting queue is ordered by (priority, arrival)
and the victim is the running request of the largest priority value (the latest among equals), which
may be one already given tokens in this step: it is taken out of the step again.

The scheduler owns the `Request` objects; the worker gets a plain-data `SchedulerOutput` per step
(protocol/sched_output.py) and keeps its own persistent batch. `update` resolves a step's results against
the requests that step ran (kept here by step id), never by id lookup alone: an id can be reused by a
new request once the old one has finished.

Prefill sharing (`_reserve`): a prompt still being chunked leaves a token to each decoding request
behind it in the running list and room for the short prompts at the waiting queue's head (whole, in
order), up to half the step, so they do not wait for its last chunk.

Structured outputs: a constrained request is admitted only once its grammar has compiled (one still
compiling is passed over, and keeps its place in the queue); each token it samples advances its
grammar matcher, and a grammar that reaches its end ends the request (the manager lives next to the
scheduler, in the engine core: structured_output/manager.py).

LoRA: a request with an adapter is admitted only once the adapter is in host memory and has (or can
take) a GPU slot; otherwise it is passed over like a compiling grammar. A running request pins its
adapter's slot (lora/manager.py), so a step never holds more distinct adapters than --max-loras.

Encoder-decoder models: a request's first step (and its first after a preemption) runs its encoder:
its encoder positions count against the step's token budget like prefill tokens (the encoder is not
chunked, so a request waits for a step with room for all of them) and its cross-attention blocks
are allocated with its first decoder blocks (`KVCacheManager.allocate_encoder`). The step message
lists the requests whose encoder runs (`encoder_runs`, with their cross blocks). Preemption frees
both groups; the request's encoder runs again when it is readmitted.

KV transfer (`connector`, kv_transfer/base.py): a waiting request whose kv_transfer_params ask for a
remote prefill, and whose prompt blocks the connector finds remotely, is given blocks for its whole
prompt and leaves the queue for `receiving` (WAITING_FOR_REMOTE_KVS) while the connector loads them;
it takes no step budget and holds up no one. When the load is done its prompt counts as computed but
for the last token (whose logits give the first output token) and it rejoins the queue's head; a
failed load either prefills here (policy recompute: its blocks go back, it is admitted like any
request) or ends the request with the reason (policy fail). On a producer, a request asking for a
remote decode keeps its blocks after it finishes (`KVCacheManager.hold`), and the connector's answer
(`kv_params_out`) goes out with its last output; the blocks go back when the connector reports the
reader's acknowledgement or the end of the lease.

Speculative decoding (`spec`, config.SpeculativeConfig): the worker proposes drafts after each step
(`Request.spec_token_ids`); a decoding request runs its last token plus as many of them as fit its
budget, its max_tokens and its context (so an accepted run never overshoots), unless its sampling
needs earlier tokens on the host (penalties, bad words), it is constrained by a grammar, it is under
min_tokens, or the running batch has reached disable_by_batch_size. Drafts count against the token
budget like any other tokens. With a step's results the request gains the accepted drafts and one
more token (stop rules applied token by token: tokens after a stop are dropped), and its computed
count goes back by the rejected drafts; since filled blocks are registered in the prefix cache only
up to the computed and known tokens, a block holding rejected K/V is never registered. A draft
model writes its next drafts' K/V beyond the verified tokens, so its requests hold
`lookahead_slots` more slots.
"""
from __future__ import annotations

import time

from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.request_queue import make_waiting_queue
from splitserve.core.spec_control import SpecController, may_speculate, plan_step, propose_next
from splitserve.protocol.sched_output import NewRequestData, ResumedRequestData, SchedulerOutput
from splitserve.core.request import Request, RequestStatus
from splitserve.ttft_trace import baseline as ttft_baseline
from splitserve.core.scheduler_kv_transfer import KVTransferScheduling
from splitserve.kv_transfer.base import wants_remote_prefill

__all__ = ["Scheduler", "SchedulerOutput"]


class Scheduler(KVTransferScheduling):
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, structured=None, lora=None,
                 connector=None, kv_load_failure_policy: str = "recompute", spec=None):
        self.config = config
        self.spec = spec  # config.SpeculativeConfig, or None (no speculative decoding)
        # Acceptance counters (vLLM's spec_decode metrics): verifying sequences, their drafts, the
        # accepted ones, and accepted drafts by position.
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * (spec.num_speculative_tokens if spec is not None else 0)
        # Drafts per sequence and step from measured acceptance and the batch (core/spec_control.py).
        self.spec_control = SpecController(spec) if spec is not None else None
        self.kv = kv_manager
        self.structured = structured  # StructuredOutputManager, or None (no constrained requests)
        self.lora = lora  # lora.manager.LoRAManager, or None (LoRA not enabled)
        # Arrival order (fcfs) or (priority, arrival) order: core/request_queue.py.
        self.waiting = make_waiting_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._num_steps = 0
        # Launched steps whose results have not come back: step id -> [(request, num tokens)].
        self._steps: dict[int, list[tuple[Request, int]]] = {}
        # Removals the worker has not been told about yet (they go out with the next message).
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        # Whether a decoder-only request with images was ever added: until then (text models always)
        # no step walks the waiting queue for images to announce.
        self._has_image_requests = False
        self.connector = connector  # a kv_transfer KVConnector, or None
        self.kv_load_failure_policy = kv_load_failure_policy
        self.receiving: dict[str, Request] = {}  # loading their prompt's KV from another engine
        self.kv_failed: list[Request] = []  # ended by a failed load (policy fail); the core reports them
        self.num_prompt_tokens_computed = 0  # prompt tokens run by steps (not cached, not loaded)
        # Prefill sharing (_reserve); off only for before/after measurements (ttft_trace.py).
        self.share_prefill = not ttft_baseline()

    # -- admission -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_encoder_tokens >= self.config.max_num_batched_tokens:
            raise ValueError(f"the encoder input has {request.num_encoder_tokens} positions; a step runs at most "
                             f"{self.config.max_num_batched_tokens} tokens (max_num_batched_tokens) including "
                             f"the decoder's first token")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.mm_items and not request.num_encoder_tokens:
            self._has_image_requests = True  # from now on steps look for images to announce

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.receiving)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's message. It always carries the removals since the last message, even when
        nothing is scheduled (the engine then sends it without running a step)."""
        self._num_steps += 1
        out = SchedulerOutput(step_id=self._num_steps)
        num_tokens = out.num_scheduled_tokens
        cached = out.cached_requests
        scheduled: list[tuple[Request, int]] = []
        budget = self.config.max_num_batched_tokens
        preempted = False
        if self.connector is not None:
            self.poll_connector()
        spec = self.spec
        speculating = spec is not None and (spec.disable_by_batch_size is None
                                            or len(self.running) < spec.disable_by_batch_size)
        lookahead = spec.lookahead_slots if spec is not None else 0
        spec_plan = {}
        if speculating:
            spec_plan = plan_step(self.spec_control, self.running, budget)

        i = 0
        reserve = None  # for the waiting queue's short head, once a chunked prompt is met (_reserve)
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.num_computed_tokens < request.num_prompt_tokens and self.share_prefill:
                if reserve is None:
                    reserve = self._reserve(budget)
                n = min(n, budget - reserve - self._decodes_after(i))
            if n <= 0 or (request.num_pending and self._at_length_limit(request)):
                # Nothing to compute, or its last token is still in flight and ends it: skip.
                i += 1
                continue
            drafts = []
            if spec is not None:
                if speculating:
                    drafts = self._drafts(request, n, budget, spec_plan.get(request.request_id, 0))
                    n += len(drafts)
                request.spec_token_ids = []  # used now or never: the next step's come with this one's results
            while not self.kv.allocate_slots(request, n + self._lookahead(request, n, lookahead) if lookahead else n):
                victim, j = self._victim()
                del self.running[j]
                if j < i:  # priority policy: a request scheduled earlier in this step gives way
                    i -= 1
                    budget += self._unschedule(out, scheduled, victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, n))
                num_tokens[request.request_id] = n
                if drafts:
                    out.spec_token_ids[request.request_id] = drafts
                if len(request.block_ids) > request.num_worker_blocks:  # its block table grew
                    cached.req_ids.append(request.request_id)
                    cached.new_block_ids.append(request.block_ids[request.num_worker_blocks:])
                    request.num_worker_blocks = len(request.block_ids)
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing is left that it could give way to

        # New work only when nothing had to give way this step.
        now = None
        compiling: list[Request] = []  # passed over: their grammar is not compiled yet
        # While requests decode, a new request's images are announced first and it is admitted a
        # step later: its tower runs beside this step instead of inside the next one (_announce_images).
        encode_ahead = self._has_image_requests and self.config.mm_encoder_budget > 0 and bool(scheduled)
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.grammar is not None and not self.structured.is_ready(request):
                compiling.append(self.waiting.popleft())
                continue
            if request.lora_request is not None and not self.lora.can_admit(request.lora_request):
                compiling.append(self.waiting.popleft())  # adapter loading, or every slot held
                continue
            if encode_ahead and request.mm_items and not request.mm_announced and not request.in_worker \
                    and not request.num_encoder_tokens:
                compiling.append(self.waiting.popleft())
                continue
            enc = request.num_encoder_tokens
            if enc and enc >= budget:
                break  # its encoder runs whole: wait for a step with room for it
            if request.block_ids:  # its prompt's KV was loaded from another engine: nothing to look up
                hits, num_cached = [], request.num_computed_tokens
            else:
                hits, num_cached = self.kv.get_computed_blocks(request)
                if self.connector is not None and self._start_remote_load(request, hits, num_cached):
                    continue
            n = min(request.num_tokens - num_cached, budget - enc)
            # The decoder's blocks first: its prefix hits may sit free in the pool, where the encoder's
            # allocation could otherwise take (and overwrite) them.
            if not self.kv.allocate_slots(request, n + self._lookahead(request, n + num_cached, lookahead), hits):
                break
            if enc and not self.kv.allocate_encoder(request):
                self.kv.free(request)  # gives back the decoder blocks (and the hits' references) just taken
                break
            self.waiting.popleft()
            if request.lora_request is not None:
                self.lora.pin(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now = now or time.monotonic()
            self.running.append(request)
            scheduled.append((request, n))
            num_tokens[request.request_id] = n
            block_ids = list(request.block_ids)
            request.num_worker_blocks = len(block_ids)
            if request.in_worker:  # preempted earlier: the worker still holds its tokens
                out.resumed_requests.append(ResumedRequestData(request.request_id, block_ids, num_cached))
            else:
                request.in_worker = True
                out.new_requests.append(NewRequestData(
                    request.request_id, request.prompt_token_ids, request.sampling_params, block_ids,
                    # announced: the worker holds its images already (their pixels cross once)
                    num_cached, request.eos_token_ids, () if request.mm_announced else request.mm_items,
                    request.mm_announced,
                    request.lora_request.lora_int_id if request.lora_request is not None else 0,
                    request.encoder_prompt_ids, enc, request.bad_words_token_ids))
            if enc:
                out.encoder_runs[request.request_id] = list(request.encoder_block_ids)
            budget -= n + enc
        self.waiting.extendleft(reversed(compiling))

        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        out.preempted_req_ids, self._preempted_ids = self._preempted_ids, []
        if not out.is_empty or out.has_removals:  # only a message the worker gets may announce:
            self._announce_images(out)            # a new request may name its announced images
        if self.lora is not None:
            out.lora_loads = self.lora.take_loads()
        if scheduled:
            self._steps[out.step_id] = scheduled
            if speculating:
                out.spec_propose = propose_next(self.spec_control, scheduled)
        return out

    def _decodes_after(self, i: int) -> int:
        """Prefill sharing: the running requests after position i that decode (one token each, left
        to them by a prompt chunk before them: running requests admitted after a long prompt would
        otherwise get no token until its last chunk)."""
        return sum(1 for r in self.running[i + 1:] if r.num_computed_tokens >= r.num_prompt_tokens)

    def _reserve(self, budget: int) -> int:
        """Prefill sharing: what a prompt still in its prefill leaves of the step's `budget` to the
        waiting requests at the queue's head that can run whole prompts now (each fits in what is
        left of half the budget), so they sample their first token in this step rather than after
        the long prompt's last chunk. In queue order, stopping at the first that does not fit (no
        request is passed over); at most half the budget, so a long prompt still runs at least half
        of every step it shares with them."""
        cap = budget // 2
        reserve, room = 0, min(self.config.max_num_seqs - len(self.running), 64)
        for request in self.waiting:
            need = request.num_tokens - request.num_computed_tokens + request.num_encoder_tokens
            if room <= 0 or reserve + need > cap:
                break
            reserve += need
            room -= 1
        return reserve

    def _announce_images(self, out: SchedulerOutput) -> None:
        """Announces the images of the next waiting requests (as far ahead as one batch of running
        requests) to the worker once, so that it can encode them before their admission, beside this
        step. The encoder budget (image tokens per step; at least one request's) chunks a burst of
        images across steps, so no step's tower work stalls the decodes."""
        left = self.config.mm_encoder_budget
        if not self._has_image_requests or left <= 0:
            return
        for k, request in enumerate(self.waiting):
            if k >= self.config.max_num_seqs or left <= 0:
                break
            if request.mm_items and not request.mm_announced and not request.in_worker \
                    and not request.num_encoder_tokens:
                request.mm_announced = True
                out.mm_prefetch[request.request_id] = request.mm_items
                left -= sum(item.num_tokens for item in request.mm_items)

    def _drafts(self, request: Request, n: int, budget: int, planned: int) -> list[int]:
        """The drafts a running request verifies this step: only while decoding (one token to
        compute, none in flight), as many as the controller's plan (`planned`), the budget,
        max_tokens and the context leave room for (the accepted ones plus one more token must fit)."""
        proposed = request.spec_token_ids
        params = request.sampling_params
        if not proposed or n != 1 or request.num_pending or not may_speculate(request):
            return []
        room = min(planned, budget - n, request.max_total_tokens - request.num_tokens - 1)
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        drafts = proposed[:max(room, 0)]
        if drafts and request.grammar is not None:
            # Up to the first draft its grammar refuses, included: that row's mask makes the target
            # reject it (dropping it instead would bias a sampled draft model's exact verification).
            drafts = drafts[:self.structured.valid_drafts(request, drafts) + 1]
        return drafts

    @staticmethod
    def _lookahead(request: Request, num_after: int, lookahead: int) -> int:
        """Slots beyond a step's tokens for a draft model's next drafts (num_after: the tokens the
        step adds to its computed ones, prefix hits included at admission), never past its context."""
        if not lookahead:
            return 0
        return max(0, min(lookahead, request.max_total_tokens - request.num_computed_tokens - num_after))

    def _victim(self) -> tuple[Request, int]:
        """The running request to preempt and its index: the newest (fcfs), or the lowest priority
        (the largest value; the latest arrival among equals) under the priority policy."""
        if self.config.policy == "priority":
            running = self.running
            # Scanned from the end: max keeps the first of equals, so the newest of them.
            j = max(reversed(range(len(running))), key=lambda k: (running[k].priority, running[k].arrival_time))
            return running[j], j
        return self.running[-1], len(self.running) - 1

    @staticmethod
    def _unschedule(out: SchedulerOutput, scheduled: list[tuple[Request, int]], request: Request) -> int:
        """Takes a request out of the step being built; returns the tokens it had been given."""
        n = out.num_scheduled_tokens.pop(request.request_id, 0)
        out.spec_token_ids.pop(request.request_id, None)
        scheduled[:] = [(r, k) for r, k in scheduled if r is not request]
        cached = out.cached_requests
        if request.request_id in cached.req_ids:
            k = cached.req_ids.index(request.request_id)
            del cached.req_ids[k], cached.new_block_ids[k]
        return n

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        if request.lora_pinned:
            self.lora.unpin(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_worker_blocks = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._preempted_ids.append(request.request_id)

    @staticmethod
    def samples_after(request: Request, num_tokens: int) -> bool:
        """Whether a request scheduled for num_tokens samples in that step (asked before `advance`;
        a verifying request's num_tokens includes its drafts)."""
        return request.num_computed_tokens + num_tokens >= request.num_tokens

    @staticmethod
    def _at_length_limit(request: Request) -> bool:
        max_tokens = request.sampling_params.max_tokens
        return (max_tokens is not None and request.num_output_tokens >= max_tokens) or \
            request.num_tokens >= request.max_total_tokens

    # -- results ---------------------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> int:
        """Once a step is launched: its tokens count as computed, and each request whose tokens are
        all computed now samples, holding one pending token until the step's results arrive. Returns
        how many sample (the worker decides the same from its own counts)."""
        num_samples = 0
        spec = out.spec_token_ids
        for request, n in self._steps.get(out.step_id, ()):
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(n, request.num_prompt_tokens - request.num_computed_tokens)
            request.num_computed_tokens += n
            # (its drafts are computed too, but only verified tokens become its own)
            verifying = len(spec[request.request_id]) if spec and request.request_id in spec else 0
            if request.num_computed_tokens - verifying == request.num_tokens:
                request.num_pending += 1
                num_samples += 1
        return num_samples

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               prompt_logprobs: dict[str, tuple] | None = None, more_tokens: dict[str, list[int]] | None = None,
               draft_token_ids: dict[str, list[int]] | None = None) -> list[Request]:
        """With a step's results: turns the pending tokens of its sampling requests into output
        tokens, applies token-level stop rules and caches filled blocks. Returns the requests that got
        a new token (finished ones included; `Request.num_new_tokens` says how many). `prompt_logprobs`:
        {id: (start, entries, ranks)} of the prompt chunks the step computed for requests that asked
        for them. Speculative decoding: `more_tokens`, the tokens after the first of requests that
        accepted drafts; `draft_token_ids`, drafts proposed for their next step."""
        updated = []
        more_tokens = more_tokens or {}
        spec = out.spec_token_ids
        steps = self._steps.pop(out.step_id, ())
        # Constrained requests' tokens advance their grammars in one call (in the grammar process,
        # with the next step's rows to fill: structured_output/process_manager.py); whose grammar ended
        # is read after the other requests are done, so the answer's wait overlaps their work.
        ended, grammar_ended = None, {}
        if self.structured is not None and self.structured.live:
            pairs = [(r, sampled[r.request_id]) for r, _ in steps  # (verifying ones: _take_verified)
                     if r.grammar is not None and not r.is_finished and r.request_id in sampled
                     and r.request_id not in spec]
            if pairs:
                ended = self.structured.accept_tokens_later(pairs)
        constrained = []
        for request, n in steps:
            if request.is_finished:  # aborted (or failed) while the step ran
                continue
            if prompt_logprobs and not request.output_token_ids:
                chunk = prompt_logprobs.get(request.request_id)
                if chunk is not None:
                    request.add_prompt_logprobs(*chunk)
            holds_blocks = request.status == RequestStatus.RUNNING  # a preempted request has none
            token = sampled.get(request.request_id)
            if token is not None:
                request.num_pending -= 1
                request.output_token_ids.append(token)
                request.num_new_tokens = 1
                updated.append(request)
                if draft_token_ids:
                    request.spec_token_ids = draft_token_ids.get(request.request_id, [])
                drafts = spec.get(request.request_id)
                if drafts:
                    self._take_verified(request, token, drafts, more_tokens.get(request.request_id, ()), holds_blocks)
                elif ended is not None and request.grammar is not None:
                    constrained.append((request, token))
                else:
                    self._check_stop(request, token)
            if holds_blocks:  # also when this token ends it: its prompt blocks serve later requests
                self.kv.cache_full_blocks(request)
            if request.is_finished:
                self._release(request)
        if constrained:
            grammar_ended = ended()
        for request, token in constrained:
            if id(request) in grammar_ended:
                reason = grammar_ended[id(request)]
                if reason is None:
                    request.status = RequestStatus.FINISHED_STOPPED  # its grammar is complete
                else:  # its grammar process was lost: the token is not checked, and not given out
                    request.status, request.stop_reason = RequestStatus.FINISHED_ERROR, reason
            else:
                self._check_stop(request, token)
            if request.is_finished:
                self._release(request)
        return updated

    def _take_verified(self, request: Request, token: int, drafts: list[int], more: list[int],
                       holds_blocks: bool) -> None:
        """A verifying request's results: its first token is appended already; the accepted drafts
        after it and the token after them are appended one by one under the stop rules (what follows
        a stop is dropped), and its computed count goes back by the rejected drafts."""
        num_accepted = len(more)
        self.spec_control.observe(request.request_id, len(drafts), num_accepted)
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(drafts)
        self.spec_num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.spec_accepted_per_pos[j] += 1
        if holds_blocks:
            request.num_computed_tokens -= len(drafts) - num_accepted
        self._check_verified_stop(request, token)
        for t in more:
            if request.is_finished:
                break
            request.output_token_ids.append(t)
            request.num_new_tokens += 1
            self._check_verified_stop(request, t)

    def _check_verified_stop(self, request: Request, token: int) -> None:
        """The stop rules for one token of an accepted run; a constrained request's grammar takes
        the token first (only the emitted tokens reach its matcher: nothing to roll back)."""
        if request.grammar is not None and self.structured.accept_token(request, token):
            request.status = RequestStatus.FINISHED_STOPPED  # its grammar is complete (or refused it)
        else:
            self._check_stop(request, token)

    def fail_step(self, out: SchedulerOutput, status: RequestStatus, launched: bool) -> list[Request]:
        """Ends the requests of a step that failed (at launch, or when its results were read). A
        message that never reached the worker (launched=False) has its removals and LoRA slot loads
        sent again with the next one."""
        failed = []
        for request, _ in self._steps.pop(out.step_id, ()):
            if not request.is_finished:
                request.status = status
                self._release(request)
                failed.append(request)
        if not launched:
            self._finished_ids[:0] = out.finished_req_ids
            self._preempted_ids[:0] = out.preempted_req_ids
            for rid in out.mm_prefetch:  # lost with the message: announced again, with the pixels
                request = self.requests.get(rid)
                if request is not None and not request.in_worker:
                    request.mm_announced = False
            if self.lora is not None:
                self.lora.restore_loads(out.lora_loads)
        return failed

    def forget_steps(self) -> None:
        """Drops the records of launched steps whose results will never be read."""
        self._steps.clear()

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
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.receiving[rid]
                self.connector.cancel(rid)
            if self.connector is not None and not request.kv_load_tried \
                    and wants_remote_prefill(request.kv_transfer_params):
                # It never read its remote blocks: the producer may free them now, not at lease end.
                request.kv_load_tried = True
                self.connector.discard(rid, request.kv_transfer_params)
            request.status = status
            self._release(request)
            done.append(request)
        return done

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:  # preempted while its last step ran, then finished by its result
            self.waiting.remove(request)
        if self.connector is None or request.kv_transfer_params is None or not self._hold_for_reader(request):
            self.kv.free(request)
        if request.lora_pinned:
            self.lora.unpin(request)
        self.requests.pop(request.request_id, None)
        if self.spec_control is not None:
            self.spec_control.forget(request.request_id)
        if request.grammar is not None:
            self.structured.release(request)
        if request.in_worker or request.mm_announced:  # (announced: the worker may hold its images)
            self._finished_ids.append(request.request_id)
            request.in_worker = request.mm_announced = False
