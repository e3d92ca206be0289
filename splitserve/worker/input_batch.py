"""The worker's persistent batch: what it keeps about each request between steps.

The scheduler sends a request's full data once (`NewRequestData`) and afterwards only deltas (see
protocol/sched_output.py). The worker keeps, per request, a `CachedRequestState` (prompt, the tokens it
sampled itself, sampling parameters and its seeded generator, images) and, while the request is in
the running batch, a row of numpy arrays: its token ids, block table, computed / known / total token
counts and sampling parameters. Rows are reused through a free list and never moved; a step gathers
its rows by index, so the layout of a step is vectorized over rows and the bookkeeping of a message
costs O(requests it changes).

Token counts of a row: `num_known` tokens are on the host (prompt + collected outputs),
`num_tokens` counts also the one token a launched step has sampled but not yet returned (async
scheduling), and `num_computed` are those whose K/V are written (or being written by a launched
step). A row whose step input is its pending token records where that token is: sample index
`pending_src` of the launched step `pending_step`; the runner copies it on the device.

A preempted request leaves its row but keeps its state (tokens, generator): when it is resumed the
row is rebuilt from the state. A finished request's state is dropped. A launched step holds the
states of its sampling rows, so tokens it returns after its request left are harmless.
"""
from __future__ import annotations

import heapq

import numpy as np

from splitserve.layers.sampling_metadata import BANNED

from splitserve.protocol.sched_output import NewRequestData, SchedulerOutput


class CachedRequestState:
    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "sampling_params", "eos_token_ids",
                 "mm_items", "min_tokens_bans", "bias_ids", "bias_values", "allowed_ids", "bad_word_seqs",
                 "generator", "row", "num_pending", "pending_src", "pending_step", "lora_id", "_batch")

    def __init__(self, new: NewRequestData, batch: "InputBatch"):
        self.req_id = new.req_id
        self.prompt_token_ids = new.prompt_token_ids
        self.output_token_ids: list[int] = []   # every token this worker sampled for it, in order
        self.sampling_params = new.sampling_params
        self.eos_token_ids = new.eos_token_ids
        self.mm_items = batch.take_mm_items(new)
        self.lora_id = new.lora_id
        p = new.sampling_params
        vocab = batch.vocab_size
        # Ids it may not sample while under min_tokens.
        bans = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(new.eos_token_ids))
        self.min_tokens_bans = np.array(sorted({t for t in bans if t < vocab}), dtype=np.int64)
        # Its constant logit changes, as (ids, values): logit_bias, and bad words of one token (banned).
        bias = {t: v for t, v in (p.logit_bias or {}).items() if t < vocab}
        bad_seqs = new.bad_words_token_ids
        bias.update((s[0], BANNED) for s in bad_seqs if len(s) == 1 and s[0] < vocab)
        self.bias_ids = np.fromiter(bias, dtype=np.int64, count=len(bias)) if bias else None
        self.bias_values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias)) if bias else None
        # Only these may be sampled (allowed_token_ids).
        allowed = sorted({t for t in p.allowed_token_ids or () if t < vocab})
        self.allowed_ids = np.array(allowed, dtype=np.int64) if p.allowed_token_ids is not None else None
        # Bad words of several tokens: their last token is banned right after the ones before it.
        self.bad_word_seqs = tuple(tuple(s) for s in bad_seqs if len(s) > 1 and s[-1] < vocab)
        self.generator = None  # torch.Generator of a seeded request, made on its first sample
        self.row = -1
        # Saved from the row while out of the batch (preempted with a token in flight).
        self.num_pending = 0
        self.pending_src = -1
        self.pending_step = -1
        self._batch = batch

    @property
    def is_active(self) -> bool:
        """In the running batch (not preempted, not finished)."""
        return self.row >= 0

    @property
    def num_computed_tokens(self) -> int:
        return int(self._batch.num_computed[self.row]) if self.row >= 0 else 0

    def __repr__(self) -> str:
        return f"CachedRequestState({self.req_id!r}, row={self.row})"


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 vocab_size: int = 2 ** 62):
        R = max_num_reqs
        self.max_num_reqs = R
        self.vocab_size = vocab_size  # token ids at or past it are dropped from per-request bans and biases
        # One position more than the context: a row never overflows even on a wasted async slot.
        # np.zeros maps untouched pages lazily: memory follows the tokens actually held.
        self.token_ids = np.zeros((R, max_model_len + 1), dtype=np.int32)
        self.block_table = np.zeros((R, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(R, dtype=np.int64)
        self.num_prompt = np.zeros(R, dtype=np.int64)
        self.num_known = np.zeros(R, dtype=np.int64)
        self.num_tokens = np.zeros(R, dtype=np.int64)
        self.num_computed = np.zeros(R, dtype=np.int64)
        self.pending_src = np.full(R, -1, dtype=np.int64)
        self.pending_step = np.full(R, -1, dtype=np.int64)
        self.mm_end = np.zeros(R, dtype=np.int64)  # end of the last image placeholder run (0: none)
        self.lora_id = np.zeros(R, dtype=np.int64)  # the row's LoRA adapter id (0: none)
        # Sampling parameters per row.
        self.greedy = np.zeros(R, dtype=bool)
        self.temperature = np.zeros(R, dtype=np.float64)
        self.top_k = np.zeros(R, dtype=np.int64)
        self.top_p = np.ones(R, dtype=np.float64)
        self.min_p = np.zeros(R, dtype=np.float64)
        self.seeded = np.zeros(R, dtype=bool)      # draws from its own generator (seeded, not greedy)
        self.penalties = np.zeros(R, dtype=bool)
        self.num_logprobs = np.full(R, -1, dtype=np.int64)  # -1: none asked
        # prompt_logprobs' k per row (-1: none asked), and how many rows ask: a step looks at the
        # rows only when some do (worker/prompt_logprobs.py).
        self.num_prompt_logprobs = np.full(R, -1, dtype=np.int64)
        self.num_prompt_logprob_rows = 0
        self.min_tokens = np.zeros(R, dtype=np.int64)
        # Rows that change logits by request: a constant bias (logit_bias, one-token bad words),
        # allowed_token_ids, bad words of several tokens (read the row's last tokens on the host).
        self.has_bias = np.zeros(R, dtype=bool)
        self.has_allowed = np.zeros(R, dtype=bool)
        self.has_bad_seqs = np.zeros(R, dtype=bool)

        self.states: dict[str, CachedRequestState] = {}  # every request held, in the batch or preempted
        # Images announced for waiting requests (SchedulerOutput.mm_prefetch), by request id, until the
        # request arrives as new (its NewRequestData then carries no pixels) or is reported finished.
        self.announced_mm: dict[str, tuple] = {}
        self.row_of: dict[str, int] = {}                  # requests in the batch -> row
        self.row_states: list[CachedRequestState | None] = [None] * R
        self._free_rows = list(range(R))                  # a heap: the lowest free row first

    @property
    def num_reqs(self) -> int:
        """Requests in the running batch."""
        return len(self.row_of)

    # -- the step message's deltas -----------------------------------------------------------------
    def take_mm_items(self, new: NewRequestData) -> tuple:
        """A new request's images: sent with it, or (mm_prefetched) announced earlier and kept here."""
        if not new.mm_prefetched:
            return new.mm_items
        items = self.announced_mm.pop(new.req_id, None)
        if items is None:
            raise RuntimeError(f"request {new.req_id!r} names images announced earlier, but none were")
        return items

    def update(self, sched: SchedulerOutput) -> None:
        """Applies a message's deltas: removals first, then new and resumed requests, then blocks;
        then the images it announces (kept until their request arrives as new or finishes)."""
        for rid in sched.finished_req_ids:
            self.announced_mm.pop(rid, None)
            state = self.states.pop(rid, None)
            if state is not None and state.row >= 0:
                self._vacate(state)
        for rid in sched.preempted_req_ids:
            state = self.states.get(rid)
            if state is not None and state.row >= 0:
                self._vacate(state)
        for new in sched.new_requests:
            old = self.states.pop(new.req_id, None)
            if old is not None and old.row >= 0:
                self._vacate(old)
            state = CachedRequestState(new, self)
            self.states[new.req_id] = state
            self._place(state, new.block_ids, new.num_computed_tokens)
        for resumed in sched.resumed_requests:
            state = self.states[resumed.req_id]
            if state.row >= 0:
                self._vacate(state)
            self._place(state, resumed.block_ids, resumed.num_computed_tokens)
        cached = sched.cached_requests
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids):
            row = self.row_of[rid]
            n = int(self.num_blocks[row])
            self.block_table[row, n:n + len(block_ids)] = block_ids
            self.num_blocks[row] = n + len(block_ids)
        if sched.mm_prefetch:
            self.announced_mm.update(sched.mm_prefetch)

    def _place(self, state: CachedRequestState, block_ids: list[int], num_computed: int) -> None:
        if not self._free_rows:
            raise RuntimeError(f"the persistent batch is full ({self.max_num_reqs} rows)")
        row = heapq.heappop(self._free_rows)
        state.row = row
        self.row_states[row] = state
        self.row_of[state.req_id] = row
        num_prompt = len(state.prompt_token_ids)
        num_known = num_prompt + len(state.output_token_ids)
        self.token_ids[row, :num_prompt] = state.prompt_token_ids
        if state.output_token_ids:
            self.token_ids[row, num_prompt:num_known] = state.output_token_ids
        self.num_prompt[row] = num_prompt
        self.num_known[row] = num_known
        self.num_tokens[row] = num_known + state.num_pending
        self.pending_src[row] = state.pending_src
        self.pending_step[row] = state.pending_step
        self.num_computed[row] = num_computed
        self.block_table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        self.mm_end[row] = state.mm_items[-1].end if state.mm_items else 0
        self.lora_id[row] = state.lora_id
        p = state.sampling_params
        self.greedy[row] = p.greedy
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.seeded[row] = p.seed is not None and not p.greedy
        self.penalties[row] = p.needs_penalties
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.num_prompt_logprob_rows += p.prompt_logprobs is not None
        self.min_tokens[row] = p.min_tokens if len(state.min_tokens_bans) else 0
        self.has_bias[row] = state.bias_ids is not None
        self.has_allowed[row] = state.allowed_ids is not None
        self.has_bad_seqs[row] = bool(state.bad_word_seqs)

    def _vacate(self, state: CachedRequestState) -> None:
        row = state.row
        # A token still in flight comes back later (record_sampled); keep where it will land.
        state.num_pending = int(self.num_tokens[row] - self.num_known[row])
        state.pending_src = int(self.pending_src[row])
        state.pending_step = int(self.pending_step[row])
        self.row_states[row] = None
        if self.num_prompt_logprobs[row] >= 0:
            self.num_prompt_logprobs[row] = -1
            self.num_prompt_logprob_rows -= 1
        del self.row_of[state.req_id]
        heapq.heappush(self._free_rows, row)
        state.row = -1

    # -- one step ------------------------------------------------------------------------------------
    def rows_of(self, req_ids) -> np.ndarray:
        """Rows of the given requests (in the batch), in the given order."""
        return np.fromiter(map(self.row_of.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))

    def record_launch(self, rows: np.ndarray, seq_lens: np.ndarray, sample_rows: np.ndarray, step_no: int) -> None:
        """A step was launched over `rows`: their tokens up to seq_lens are computed, and each of
        `sample_rows` holds one pending token, sample index i of step step_no."""
        self.num_computed[rows] = seq_lens
        self.num_tokens[sample_rows] += 1
        self.pending_src[sample_rows] = np.arange(len(sample_rows))
        self.pending_step[sample_rows] = step_no

    def record_sampled(self, states: list[CachedRequestState], tokens: list[int]) -> None:
        """A launched step's tokens reached the host: they become known tokens of their requests."""
        rows, values = [], []
        for state, token in zip(states, tokens):
            state.output_token_ids.append(token)
            if state.row >= 0:
                rows.append(state.row)
                values.append(token)
            elif state.num_pending:  # left the batch while this token was in flight
                state.num_pending -= 1
        if rows:
            r = np.array(rows, dtype=np.int64)
            self.token_ids[r, self.num_known[r]] = values
            self.num_known[r] += 1

    def record_verified(self, states: list[CachedRequestState], tokens: list[list[int]], rejected: list[int]) -> None:
        """A verify step's tokens reached the host: each request's accepted drafts and the token after
        them become known, and its computed count goes back by its rejected drafts (their K/V slots
        are rewritten by the next step). Verify steps are collected before the next launch."""
        for state, new, num_rejected in zip(states, tokens, rejected):
            state.output_token_ids += new
            row = state.row
            if row < 0:  # left the batch while the step ran
                state.num_pending = max(0, state.num_pending - 1)
                continue
            known = int(self.num_known[row])
            self.token_ids[row, known:known + len(new)] = new
            self.num_known[row] = known + len(new)
            self.num_tokens[row] += len(new) - 1  # the one pending token counted at launch, and the rest
            self.num_computed[row] -= num_rejected
