"""The server's engine: the front on the event loop, the core on its own (a process, or a thread).

`AsyncLLMEngine.launch(args)` starts the engine core in a process of its own (what `splitserve
serve` does): the scheduler and the model never share an interpreter with HTTP, tokenization and
detokenization. `AsyncLLMEngine(llm_engine)` drives an engine built in this process with the same
loop on a thread (tests, embedding). Either way the front talks to the core through the messages of
messages.py over ZeroMQ, one per step each way (core_loop.py), and every request has its own asyncio
queue of outputs. A receiver thread waits on the core's socket and hands each step's message to the
event loop, which runs the output processor (detokenization, stop strings) and feeds the streams.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

import msgspec
import zmq

from splitserve.protocol.core_messages import (AbortRequests, AddRequests, Codec, CoreToFront, CoreReady, EngineCoreOutputs,
                                        FrontToCore, SchedulerStats, Shutdown)
from splitserve.engine.output_processor import RequestOutput
from splitserve.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

# How often the receiver thread looks at the core process when no message comes.
_WATCH_INTERVAL_MS = 200


class EngineOverloadedError(RuntimeError):
    """The wait queue is full; the caller should retry later (HTTP 503)."""


class EngineShutdownError(RuntimeError):
    """The engine is stopping or stopped and takes no new requests (HTTP 503)."""


class EngineRequestError(RuntimeError):
    """The engine failed while running this request; the engine itself keeps serving."""


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


class _CorePlacement:
    """Where the core runs and how the front reaches it: two bound sockets, and a process or a thread."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="splitserve-")
        self.input_addr = f"ipc://{self.dir}/input"
        self.output_addr = f"ipc://{self.dir}/output"
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        # Never block on a busy core (no high-water mark); a send waits only while the core has not
        # connected yet (a core thread just started), and never longer than this.
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.setsockopt(zmq.SNDTIMEO, 5000)
        self.input.bind(self.input_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(self.output_addr)
        self.process: multiprocessing.Process | None = None
        self.thread: threading.Thread | None = None

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.thread is not None and self.thread.is_alive()

    def exit_description(self) -> str:
        if self.process is not None:
            return f"the engine core process died (exit code {self.process.exitcode})"
        return "the engine core thread stopped"

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # closes both sockets (a core thread that never ended cannot block this)
        shutil.rmtree(self.dir, ignore_errors=True)


class AsyncLLMEngine:
    def __init__(self, engine=None, max_queued_requests: int | None = None,
                 on_output: Callable[[RequestStream, RequestOutput, float], None] | None = None, *,
                 front=None, placement: _CorePlacement | None = None):
        """`engine`: an LLMEngine whose core this object drives on a thread. (`launch` builds the
        other placement, the core in a process of its own, and passes `front` and `placement`.)"""
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        if placement is None:
            placement = _CorePlacement()
            placement.thread = threading.Thread(target=self._run_core_thread, args=(engine.core, placement),
                                                name="splitserve-engine-core", daemon=True)
            front = engine.front
        self.engine = engine if engine is not None else front  # tokenizer, config, model name, validation
        self.front = front
        self.max_queued_requests = max_queued_requests
        # Called on the loop thread for every output with the engine-side timestamp (for metrics).
        self.on_output = on_output
        # Called on the loop thread once if the core dies without saying why (the server exits).
        self.on_core_lost: Callable[[], None] | None = None
        # Called on the loop thread with the token count of each engine step (for metrics).
        self.on_step_tokens: Callable[[list[int]], None] | None = None
        self._placement = placement
        self._to_core = Codec(FrontToCore)
        self._send_lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._dead: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}   # loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiver: threading.Thread | None = None
        self._num_sent = 0  # sequences sent to the core (it reports how many it has taken in)
        self.stats = SchedulerStats()
        self._max_running = front.config.scheduler.max_num_seqs

    @staticmethod
    def _run_core_thread(core, placement: _CorePlacement) -> None:
        from splitserve.engine.core_loop import connect_sockets, run_core_loop
        inp, out = connect_sockets(placement.ctx, placement.input_addr, placement.output_addr)
        try:
            run_core_loop(core, inp, out)
        except BaseException:
            logger.exception("engine core thread died")
        finally:
            inp.close(0)
            out.close(2000)

    @classmethod
    def launch(cls, args, max_queued_requests: int | None = None, stream_interval: int = 1,
               ready_timeout: float | None = None) -> "AsyncLLMEngine":
        """Starts the engine core in a process of its own and builds the front here meanwhile."""
        from splitserve.engine.core_loop import core_process_main
        from splitserve.engine.front import EngineFront, build_front_mm_processor, load_front_tokenizer
        config = args.create_engine_config()  # bad arguments fail here, before any process starts
        placement = _CorePlacement()
        try:
            placement.process = multiprocessing.get_context("spawn").Process(
                target=core_process_main, name="splitserve-engine-core",
                args=(config, placement.input_addr, placement.output_addr, os.getpid(), logging.getLogger().level))
            placement.process.start()
            tokenizer = load_front_tokenizer(config)
            mm_processor = build_front_mm_processor(config, tokenizer)
            ready = cls._wait_ready(placement, ready_timeout)
            front = EngineFront(config, tokenizer, ready.num_blocks, ready.block_size, mm_processor, stream_interval)
        except BaseException:
            if placement.process is not None and placement.process.is_alive():
                placement.process.kill()
                placement.process.join(5)
            placement.close()
            raise
        logger.info("engine core process %d ready", placement.process.pid)
        return cls(max_queued_requests=max_queued_requests, front=front, placement=placement)

    @staticmethod
    def _wait_ready(placement: _CorePlacement, timeout: float | None) -> CoreReady:
        deadline = None if timeout is None else time.monotonic() + timeout
        decoder = Codec(CoreToFront)
        while deadline is None or time.monotonic() < deadline:
            if placement.output.poll(_WATCH_INTERVAL_MS):
                msg = decoder.decode(placement.output.recv())
                if not isinstance(msg, CoreReady):
                    raise RuntimeError(f"the engine core sent {type(msg).__name__} before it was ready")
                if msg.error:
                    raise RuntimeError(f"the engine core failed to start: {msg.error}")
                return msg
            if not placement.alive():
                raise RuntimeError(f"{placement.exit_description()} while starting")
        raise RuntimeError(f"the engine core was not ready after {timeout} s")

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Binds to the running event loop and starts the core thread (if any) and the receiver
        (idempotent)."""
        if self._receiver is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self._placement.thread is not None:
            self._placement.thread.start()
        self._receiver = threading.Thread(target=self._receive, name="splitserve-core-receiver", daemon=True)
        self._receiver.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts whatever is left, stops the core and waits for it (off the loop)."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self.abort_all()
        if self._placement.alive():
            self._send(Shutdown())
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._placement.join, timeout)
        if self._receiver is not None:
            await loop.run_in_executor(None, self._receiver.join, timeout)
        self._placement.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    @property
    def core_pid(self) -> int | None:
        return None if self._placement.process is None else self._placement.process.pid

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
        those sent to the core that it has not taken in yet plus those waiting there, less the free
        places of the batch, which the next step fills. Counted in sequences (a request with n=4
        is 4), the unit the core queues. Loop thread only: `stats` is replaced there."""
        s = self.stats
        free = max(0, self._max_running - s.num_running)
        return max(0, self._num_sent - s.num_received + s.num_waiting + num_new - free)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- requests ---------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        self._send_bytes(self._to_core.encode(msg), type(msg).__name__)

    def _send_bytes(self, data: bytes, what: str = "AddRequests") -> None:
        if self._dead is not None and not self._placement.alive():
            return  # nobody to tell
        with self._send_lock:
            try:
                self._placement.input.send(data)
            except (zmq.Again, zmq.ZMQError):  # the core is gone; its loss is reported elsewhere
                logger.warning("could not send %s to the engine core", what)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    lora_request=None, priority: int = 0) -> RequestStream:
        """Validates and queues a request; returns its stream. Raises at once (before anything is
        queued) with ValueError for bad input, EngineOverloadedError when the queue is full and
        EngineShutdownError when stopping. Must be called on the event loop thread; the server hands
        over token ids, tokenized off the loop."""
        self.start()
        if self._dead is not None:
            raise EngineShutdownError(f"the engine has stopped after an error: {self._dead}")
        if self._stopping:
            raise EngineShutdownError("the engine is shutting down")
        if self.max_queued_requests is not None:
            most = self.max_queued_requests + self._max_running  # even an idle engine takes no more
            if params.n > most:
                raise SamplingParamsError("n", f"n must be <= {most} on this server (--max-queued-requests "
                                               f"{self.max_queued_requests} + --max-num-seqs {self._max_running}), "
                                               f"got {params.n}")
            if self._queued_with(params.n) > self.max_queued_requests:
                raise EngineOverloadedError(
                    f"the server is overloaded: {self.num_queued} requests are already waiting "
                    f"(--max-queued-requests {self.max_queued_requests}); retry later")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        request_id, core_requests = self.front.new_request(request_id, prompt, params, lora_request=lora_request,
                                                           priority=priority)
        try:
            data = self._to_core.encode(AddRequests(core_requests))
        except (msgspec.EncodeError, OverflowError) as e:  # e.g. a seed beyond 64 bits
            self.front.output_processor.abort(request_id)
            raise ValueError(f"the request has a value the engine cannot take: {e}") from None
        stream = RequestStream(request_id, core_requests[0].arrival_time)
        self._streams[request_id] = stream
        self._num_sent += len(core_requests)
        self._send_bytes(data)
        return stream

    def abort(self, request_id: str) -> None:
        """Drops a request and frees its blocks; its stream ends with finish_reason "abort". Safe
        from any thread, any time."""
        if self._loop is not None and not self._on_loop_thread():
            try:
                self._loop.call_soon_threadsafe(self.abort, request_id)
            except RuntimeError:  # the loop is closed
                pass
            return
        out, seq_ids = self.front.output_processor.abort(request_id)
        if seq_ids:
            self._send(AbortRequests(seq_ids))
        if out is not None:
            self._dispatch([out], time.monotonic())

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

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

    # -- receiver thread ------------------------------------------------------------------------------
    def _receive(self) -> None:
        """Waits for the core's messages and hands each to the loop; notices a core that is gone."""
        decoder = Codec(CoreToFront)
        sock = self._placement.output
        try:
            while True:
                if sock.poll(_WATCH_INTERVAL_MS):
                    msg = decoder.decode(sock.recv(copy=False).buffer)
                    if isinstance(msg, EngineCoreOutputs):
                        self._loop.call_soon_threadsafe(self._on_core_outputs, msg)
                    continue
                if not self._placement.alive():
                    while sock.poll(0):  # what it sent before it went
                        msg = decoder.decode(sock.recv())
                        if isinstance(msg, EngineCoreOutputs):
                            self._loop.call_soon_threadsafe(self._on_core_outputs, msg)
                    if not self._stopping:
                        self._loop.call_soon_threadsafe(self._on_core_gone, self._placement.exit_description())
                    return
        except (zmq.ZMQError, RuntimeError):  # the sockets closed at shutdown, or the loop did
            return

    # -- loop-thread side -------------------------------------------------------------------------
    def _on_core_outputs(self, msg: EngineCoreOutputs) -> None:
        self.stats = msg.stats
        if msg.step_tokens and self.on_step_tokens is not None:
            try:
                self.on_step_tokens(msg.step_tokens)
            except Exception:  # metrics must never break serving
                logger.exception("step observer failed")
        if msg.outputs:
            outputs, drop = self.front.output_processor.process(msg.outputs, msg.timestamp)
            for reason, ids in drop.items():
                self._send(AbortRequests(ids, reason))
            self._dispatch(outputs, msg.timestamp)
        if msg.dead is not None and msg.process_lost:
            # A rank is gone: the core exits after this message; fail everything now and exit (503 meanwhile).
            self._on_core_gone(f"the engine lost a process: {msg.dead}")
        if msg.dead is not None and self._dead is None:
            # The core gave up (steps keep failing): new requests get 503, /health turns 503, and the
            # server stays up to say so.
            from splitserve.core.engine_core import EngineDeadError
            self._dead = EngineDeadError(msg.dead)
            self._fail_all(self._dead)

    def _on_core_gone(self, why: str) -> None:
        if self._dead is not None:
            return
        logger.error("%s; failing %d request(s) in flight", why, len(self._streams))
        from splitserve.core.engine_core import EngineDeadError
        self._dead = EngineDeadError(why)
        self._fail_all(self._dead)
        if self.on_core_lost is not None:
            self.on_core_lost()

    def _dispatch(self, outputs: list[RequestOutput], ts: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream.engine_done = True
                self._streams.pop(out.request_id, None)
            self._observe(stream, out, ts)
            if any(o.finish_reason == "error" for o in out.outputs):
                # The core's reason when it gave one (a failed KV load under policy "fail", say).
                why = next((o.stop_reason for o in out.outputs if isinstance(o.stop_reason, str)), None)
                stream._put(EngineRequestError("the engine failed while running this request"
                                               + (f": {why}" if why else "")))
            else:
                stream._put(out)

    def _observe(self, stream: RequestStream, out: RequestOutput, ts: float) -> None:
        if self.on_output is not None:
            try:
                self.on_output(stream, out, ts)
            except Exception:  # metrics must never break serving
                logger.exception("output observer failed")

    def _fail_all(self, exc: BaseException) -> None:
        ts = time.monotonic()
        for rid in list(self._streams):
            out, _ = self.front.output_processor.abort(rid, "error")
            stream = self._streams.pop(rid)
            stream.engine_done = True
            if out is not None:  # the observer sees every request end, these too (metrics: "error")
                self._observe(stream, out, ts)
            stream._put(EngineShutdownError(f"the engine stopped: {exc}"))
