"""The asyncio front of the engine.

`LLMEngine.step()` is synchronous and runs for tens of milliseconds (seconds on a slow CPU), so it
must never run on the event loop: the loop would stop accepting connections and sending tokens.
The engine therefore lives in one dedicated thread that owns it exclusively. The loop talks to that
thread through a command list guarded by a condition variable (add / abort / stop), and the thread
hands outputs back with `loop.call_soon_threadsafe`, once per step for the whole batch. Each request
has its own asyncio queue; whoever iterates it sees the outputs of that request only.

When there is no work the thread sleeps on the condition; a new command wakes it. No polling.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from splitserve.engine.llm_engine import EngineDeadError, LLMEngine
from splitserve.engine.output_processor import RequestOutput
from splitserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the engine thread waits when the engine has work but could not schedule any of it.
_IDLE_BACKOFF_S = 0.005


class EngineOverloadedError(RuntimeError):
    """The wait queue is full; the caller should retry later (HTTP 503)."""


class EngineShutdownError(RuntimeError):
    """The engine is stopping or stopped and takes no new requests (HTTP 503)."""


class EngineRequestError(RuntimeError):
    """The engine failed while running this request; the engine itself keeps serving."""


@dataclass
class EngineStats:
    """A consistent picture of the engine, taken by the engine thread after each iteration, so
    readers on other threads never look at the scheduler while it is being mutated."""
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    num_added: int = 0       # requests the engine took in; when idle, every one of them has finished


class RequestStream:
    """The outputs of one request, in order. Fed on the event loop thread only."""

    def __init__(self, request_id: str, arrival_time: float):
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.finished = False            # the consumer has seen the final output (or an error)
        self.engine_done = False         # the engine has sent its final output
        self.metrics_state: dict[str, Any] = {}
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None,
                 on_output: Callable[[RequestStream, RequestOutput, float], None] | None = None):
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        # Called on the loop thread for every output with the engine-side timestamp (for metrics).
        self.on_output = on_output
        self._cond = threading.Condition()
        self._commands: list[tuple] = []   # ("add", id, token_ids, params, arrival) | ("abort", id)
        self._num_pending_adds = 0         # sequences (n per request) accepted, not yet in the engine
        self._stopping = False
        self._dead: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}   # loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.stats = EngineStats()
        self._num_added = 0   # engine thread only
        scheduler_config = getattr(getattr(engine, "config", None), "scheduler", None)
        self._max_running = getattr(scheduler_config, "max_num_seqs", 0)
        self._snapshot()

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Binds to the running event loop and starts the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="splitserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts whatever is left, stops the thread and waits for it (off the loop)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def num_queued(self) -> int:
        return self._queued_with(0)

    def _queued_with(self, num_new: int) -> int:
        """Sequences that will wait for a place in the running batch once `num_new` more arrive:
        those accepted but not yet handed to the engine plus those waiting in it, less the free
        places of the batch, which the next step fills. Counted in sequences (a request with n=4
        is 4), the unit the engine queues."""
        with self._cond:  # all from the same moment: see _snapshot
            free = max(0, self._max_running - self.stats.num_running)
            return max(0, self._num_pending_adds + self.stats.num_waiting + num_new - free)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Validates and queues a request; returns its stream. Raises at once (before anything is
        queued) with ValueError for bad input, EngineOverloadedError when the queue is full and
        EngineShutdownError when stopping. Must be called on the event loop thread."""
        self.start()
        if self._dead is not None:
            raise EngineShutdownError(f"the engine has stopped after an error: {self._dead}")
        if self._stopping:
            raise EngineShutdownError("the engine is shutting down")
        if self.max_queued_requests is not None:
            most = self.max_queued_requests + self._max_running  # even an idle engine takes no more
            if params.n > most:
                raise ValueError(f"n must be <= {most} on this server (--max-queued-requests "
                                 f"{self.max_queued_requests} + --max-num-seqs {self._max_running}), got {params.n}")
            if self._queued_with(params.n) > self.max_queued_requests:
                raise EngineOverloadedError(
                    f"the server is overloaded: {self.num_queued} requests are already waiting "
                    f"(--max-queued-requests {self.max_queued_requests}); retry later")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Tokenize and validate here, not in the engine thread, so bad input fails the HTTP call
        # synchronously with a 400 instead of surfacing later inside a stream.
        token_ids = self.engine.tokenize_prompt(prompt)
        self.engine.validate(token_ids, params)
        arrival = time.monotonic()
        stream = RequestStream(request_id, arrival)
        self._streams[request_id] = stream
        with self._cond:
            self._commands.append(("add", request_id, token_ids, params, arrival))
            self._num_pending_adds += params.n
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Asks the engine to drop a request and free its blocks. Safe from any thread, any time."""
        with self._cond:
            if self._stopping:
                return
            self._commands.append(("abort", request_id))
            self._cond.notify()

    def abort_all(self) -> int:
        """Aborts every request in flight (the end of a drain); returns how many. Loop thread."""
        ids = list(self._streams)
        for rid in ids:
            self.abort(rid)
        return len(ids)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the outputs of one request until it finishes. If the consumer stops early
        (cancellation, `aclose()`, a disconnected client), the request is aborted."""
        stream = self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    # -- loop-thread side -------------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput], errors: list[tuple[str, BaseException]], ts: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream.engine_done = True
                self._streams.pop(out.request_id, None)
            if self.on_output is not None:
                try:
                    self.on_output(stream, out, ts)
                except Exception:  # metrics must never break serving
                    logger.exception("output observer failed")
            if any(o.finish_reason == "error" for o in out.outputs):
                stream._put(EngineRequestError("the engine failed while running this request"))
            else:
                stream._put(out)
        for request_id, exc in errors:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.engine_done = True
                stream._put(exc)

    def _post(self, outputs: list[RequestOutput], errors: list[tuple[str, BaseException]]) -> None:
        if not outputs and not errors:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs, errors, time.monotonic())
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # -- engine thread ----------------------------------------------------------------------------
    def _snapshot(self, num_adds_done: int = 0) -> None:
        """Publishes the engine's state. `num_adds_done` sequences handed to the engine since the last
        snapshot stop counting as pending at the same moment as they start counting as waiting (one
        lock), so the queue limit neither under- nor over-counts them."""
        e = self.engine
        kv = getattr(e, "kv_manager", None)
        stats = EngineStats(
            num_running=e.num_running, num_waiting=e.num_waiting, kv_usage=e.kv_usage(),
            prefix_queries=getattr(kv, "prefix_queries", 0), prefix_hits=getattr(kv, "prefix_hits", 0),
            num_preemptions=getattr(getattr(e, "scheduler", None), "num_preemptions", 0), num_added=self._num_added)
        with self._cond:
            self.stats = stats
            self._num_pending_adds -= num_adds_done

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                num_adds = sum(c[3].n for c in commands if c[0] == "add")
                outputs: list[RequestOutput] = []
                errors: list[tuple[str, BaseException]] = []
                # Commands in arrival order, so an abort that follows its add finds the request.
                for cmd in commands:
                    if cmd[0] == "add":
                        _, rid, token_ids, params, arrival = cmd
                        try:
                            engine.add_request(rid, token_ids, params, arrival_time=arrival)
                            self._num_added += 1
                        except Exception as e:  # validated already; a failure here is ours
                            logger.exception("adding request %s failed", rid)
                            errors.append((rid, EngineRequestError(f"could not add the request: {e}")))
                    else:
                        outputs.extend(engine.abort_request(cmd[1]))
                if stopping:
                    outputs.extend(engine.abort_request(list(engine.states)))
                    self._snapshot()
                    self._post(outputs, errors)
                    return
                stepped_idle = False
                if engine.has_unfinished_requests():
                    try:
                        started = time.monotonic()
                        step_outputs = engine.step()
                        outputs.extend(step_outputs)
                        # A step that produced nothing and took no time scheduled nothing (work it
                        # cannot admit yet): back off below instead of spinning on it.
                        stepped_idle = not step_outputs and time.monotonic() - started < 1e-3
                    except EngineDeadError:
                        raise  # not recoverable: below, every request fails and /health turns 503
                    except Exception as e:
                        # The step raised outside the model call (which fails only its own batch):
                        # fail everything in flight and keep serving new requests.
                        logger.exception("engine step failed; failing all in-flight requests")
                        ids = list(engine.states)
                        try:
                            engine.abort_request(ids)
                        except Exception:
                            logger.exception("cleanup after a failed step failed")
                            engine.states.clear()
                        errors.extend((rid, EngineRequestError(f"engine step failed: {e}")) for rid in ids)
                self._snapshot(num_adds)
                self._post(outputs, errors)
                with self._cond:
                    if stepped_idle and not commands and not self._commands:
                        self._cond.wait(_IDLE_BACKOFF_S)
        except BaseException as e:  # a bug in this loop: fail every request, report unhealthy
            logger.exception("engine thread died")
            self._dead = e
            if self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._fail_all, e)
                except RuntimeError:
                    pass

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._streams):
            self._streams.pop(rid)._put(EngineShutdownError(f"the engine stopped: {exc}"))
