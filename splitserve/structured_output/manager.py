"""Grammar state of constrained requests, in the engine core next to the scheduler (the in-process
variant: `structured_outputs_fill="inline"`, and the fallback of the grammar process, whose manager
in process_manager.py keeps the same contract).

- **Compilation** runs on a thread pool, never on the step loop: the first constrained request also
  builds xgrammar's view of the vocabulary there (the tokenizer's decoded tokens, padded to the
  model's vocabulary size, whose padding ids are never allowed). Compiled grammars are cached by
  constraint key (kind, spec, options), so a schema that many requests share compiles once; a
  request whose grammar is still compiling waits in the queue without holding anyone back
  (`is_ready`, read by the scheduler's admission).
- **Matchers**: each constrained request owns an xgrammar matcher. For each step the core asks
  which constrained requests sample in it (`sampling_requests`) and for their token bitmask
  (`fill_bitmask`): one int32 row of ceil(vocab / 32) words per request; the worker masks their
  logits on the device. A step without constrained requests costs one emptiness test here and
  nothing on the device.
- **Accepting**: the scheduler feeds each sampled token to its request's matcher (`accept_token`);
  a grammar that has reached its end (the matcher accepted a stop token) ends the request.

The mask of a step needs the tokens of the step before it. With the runner in the core's process the
core launches the step's forward first, takes in the tokens of the step in flight (advancing the
matchers), then fills the masks while the device computes, and enqueues the sampler last (async
scheduling stays on). Filling on a thread of its own, to overlap the core's other host work too,
measured slower on the H100 machine (BENCHMARKS.md, eleventh session): the grammar process does that
overlap without sharing the core's GIL. Worker processes get
the masks inside the step message: there a step in which constrained requests sample is collected
before the next one is scheduled (`needs_sync`).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Callable

import torch

from splitserve.protocol.sched_output import GrammarBitmask
from splitserve.structured_output.grammar import build_grammar, error_reason

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (a compiled JSON schema is tens of kB to a few MB).
_CACHE_ENTRIES = 256


def fill_threads() -> int:
    """Threads of a batch mask fill: half the CPUs this process can use, at most 8. xgrammar's
    default counts the host's CPUs, which in a container can be many times the ones it gets: usable
    CPUs are the affinity count or the cgroup's CPU quota, whichever is smaller (cpu_limits.py). The
    fill runs beside the engine's own thread (measured on 16 CPUs: 8 threads fill 64 masks as fast
    as 16, 4 threads 20% slower; benchmarks/grammar_fill.py)."""
    from splitserve.cpu_limits import usable_cpus
    return max(1, min(8, usable_cpus() // 2))


class RequestGrammar:
    """One request's constraint: its compile (a shared future), then its own matcher."""
    __slots__ = ("key", "future", "matcher", "stop_token_ids")

    def __init__(self, key: tuple, future: Future, stop_token_ids: tuple[int, ...]):
        self.key = key
        self.future = future
        self.matcher = None
        self.stop_token_ids = stop_token_ids


class StructuredOutputManager:
    fills_elsewhere = False  # the core fills the masks itself (`fill_bitmask`)

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...],
                 tokenizer_loader: Callable[[], object], max_workers: int = 2):
        self.vocab_size = vocab_size
        self.bitmask_words = -(-vocab_size // 32)
        self._eos = list(eos_token_ids)
        self._tokenizer_loader = tokenizer_loader
        self._tokenizer = None
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._batch_matcher = None
        # Constrained requests not finished yet, by identity (an id may be reused once it finished).
        self.live: dict[int, object] = {}

    def set_tokenizer(self, tokenizer) -> None:
        """The offline engine hands over the tokenizer it already has (the core process loads its own)."""
        self._tokenizer = tokenizer

    # -- compilation (thread pool) ---------------------------------------------------------------
    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                tokenizer = self._tokenizer if self._tokenizer is not None else self._tokenizer_loader()
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._eos or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_workers)
            return self._compiler

    def _compile(self, key: tuple):
        return self._get_compiler().compile_grammar(build_grammar(key))

    def _compiled(self, key: tuple) -> Future:
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="splitserve-grammar")
        future = self._pool.submit(self._compile, key)
        self._cache[key] = future
        while len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)  # requests that hold an evicted future keep it
        return future

    # -- requests --------------------------------------------------------------------------------
    def register(self, request) -> None:
        """Starts (or reuses) the compile of a constrained request's grammar."""
        params = request.sampling_params.structured_outputs
        try:
            key = params.key()
        except ValueError as e:  # the front checks this; a request from elsewhere fails at admission
            future = Future()
            future.set_exception(e)
            key = None
        else:
            future = self._compiled(key)
        request.grammar = RequestGrammar(key, future, tuple(request.eos_token_ids))
        self.live[id(request)] = request

    def release(self, request) -> None:
        self.live.pop(id(request), None)

    def is_ready(self, request) -> bool:
        """Its grammar is compiled (its matcher is made here, on the first look after that). A
        failed compile counts as not ready: `take_failed` ends such requests."""
        grammar = request.grammar
        if grammar.matcher is not None:
            return True
        if not grammar.future.done() or grammar.future.exception() is not None:
            return False
        import xgrammar as xgr
        grammar.matcher = xgr.GrammarMatcher(grammar.future.result(),
                                             override_stop_tokens=list(grammar.stop_token_ids) or None)
        return True

    def take_failed(self) -> list[tuple[object, str]]:
        """Live requests whose grammar failed to compile, with the reason (the core ends them)."""
        failed = []
        for request in list(self.live.values()):
            future = request.grammar.future
            if request.grammar.matcher is None and future.done() and future.exception() is not None:
                failed.append((request, f"structured output grammar failed to compile: "
                                        f"{error_reason(future.exception())}"))
                self.release(request)
        return failed

    def has_pending_compiles(self) -> bool:
        return any(r.grammar.matcher is None and not r.grammar.future.done() for r in self.live.values())

    def wait_for_compiles(self, timeout: float) -> None:
        pending = [r.grammar.future for r in self.live.values() if not r.grammar.future.done()]
        if pending:
            futures_wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # -- steps -----------------------------------------------------------------------------------
    def sampling_requests(self, sched, sampling: Callable[[object, int], bool]) -> list:
        """The constrained requests (compiled) that sample in this step, in no particular order.
        sampling(request, num_scheduled_tokens) says whether a scheduled request samples."""
        if not self.live:
            return []
        num_tokens = sched.num_scheduled_tokens
        requests = []
        for request in self.live.values():
            n = num_tokens.get(request.request_id)
            if n and request.grammar.matcher is not None and sampling(request, n):
                requests.append(request)
        return requests

    def valid_drafts(self, request, drafts: list[int]) -> int:
        """Speculative decoding: how many of a request's drafts (a prefix) its grammar accepts from
        its current state; the matcher is rolled back to that state afterwards."""
        matcher = request.grammar.matcher
        n = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def fill_bitmask(self, requests: list, drafts: dict[str, list[int]] | None = None) -> torch.Tensor:
        """The masks of `requests` (row i for requests[i]). A request that ended since it was
        scheduled (its last token finished it, or it was aborted) gets an all-allowed row: what it
        samples in this step is discarded. Speculative decoding (`drafts`: the step's drafts by
        request id): a verifying request has d + 1 consecutive rows, row j the mask after its first
        j drafts (the grammar accepted them when they were scheduled: `valid_drafts`)."""
        drafts = drafts or {}
        num_rows = [1 + len(drafts.get(r.request_id, ())) for r in requests]
        bitmask = torch.full((sum(num_rows), self.bitmask_words), -1, dtype=torch.int32)
        rows, matchers = [], []
        row = 0
        for request, n in zip(requests, num_rows):
            matcher = request.grammar.matcher
            if n > 1 and not request.is_finished:
                accepted = 0
                for j, token in enumerate(drafts[request.request_id]):
                    if matcher.is_terminated():
                        break
                    matcher.fill_next_token_bitmask(bitmask, row + j)
                    if not matcher.accept_token(token):  # (checked when scheduled: not expected)
                        break
                    accepted += 1
                else:
                    if not matcher.is_terminated():
                        matcher.fill_next_token_bitmask(bitmask, row + n - 1)
                if accepted:
                    matcher.rollback(accepted)
            elif not request.is_finished and not matcher.is_terminated():
                rows.append(row)
                matchers.append(matcher)
            row += n
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        elif matchers:
            if self._batch_matcher is None:
                import xgrammar as xgr
                self._batch_matcher = xgr.BatchGrammarMatcher(fill_threads())
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask

    def step_bitmask(self, sched, sampling: Callable[[object, int], bool]) -> GrammarBitmask | None:
        """The bitmask rows of the constrained requests that sample in this step (None if none do)."""
        requests = self.sampling_requests(sched, sampling)
        if not requests:
            return None
        return GrammarBitmask([r.request_id for r in requests], self.fill_bitmask(requests))

    def accept_token(self, request, token: int) -> bool:
        """Advances the request's matcher; True when the request must end here (its grammar reached
        its end, or refused the token: nothing valid can follow)."""
        matcher = request.grammar.matcher
        if matcher is None:
            return False
        if not matcher.accept_token(token):
            logger.warning("request %s: sampled token %d is not allowed by its grammar; ending it",
                           request.request_id, token)
            return True
        return matcher.is_terminated()

    def accept_tokens(self, pairs: list[tuple[object, int]]) -> dict[int, str | None]:
        """A step's tokens, one (request, token) pair per constrained request that sampled: {id(request):
        None} for those that must end (see accept_token). The grammar process's manager has the same
        call, and may give a reason instead of None (its process was lost: the request fails)."""
        return {id(request): None for request, token in pairs if self.accept_token(request, token)}

    def accept_tokens_later(self, pairs: list[tuple[object, int]]) -> Callable[[], dict[int, str | None]]:
        """accept_tokens, with its answer read when the returned function is called (here at once)."""
        ended = self.accept_tokens(pairs)
        return lambda: ended

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
