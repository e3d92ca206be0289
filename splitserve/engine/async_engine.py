"""The server's engine: the front on the event loop, the core on its own (a process, or a thread).

`AsyncLLMEngine.launch(args)` starts the engine core in a process of its own (what `splitserve
serve` does): the scheduler and the model never share an interpreter with HTTP, tokenization and
detokenization. With `--data-parallel-size N` it starts N cores (replicas.py) and routes each request
to one of them (replica_router.py); a replica that dies fails only its own requests and is restarted.
`AsyncLLMEngine(llm_engine)` drives an engine built in this process with the same loop on a thread
(tests, embedding). Either way the front talks to a core through the messages of
protocol/core_messages.py over ZeroMQ, one per step each way (core_loop.py), and every request has
its own asyncio queue of outputs. A receiver thread per core waits on its socket and hands each step's
message to the event loop, which runs the output processor (detokenization, stop strings) and feeds
the streams.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

import msgspec
import zmq

from splitserve.ttft_trace import enabled as ttft_enabled
from splitserve.engine.replica_router import ReplicaRouter
from splitserve.engine.replicas import CorePlacement, Replica, replica_devices, total_stats
from splitserve.protocol.core_messages import (AbortRequests, AddRequests, Codec, EngineCoreOutputs, FrontToCore,
                                               SchedulerStats, Shutdown)
from splitserve.engine.output_processor import RequestOutput
from splitserve.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)


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
        self.num_seqs = 1                # its sequences (n)
        # TTFT breakdown (ttft_trace.py), when on: the core's trace of its first token, the
        # message's timestamp and when the front took it in; and the handler's start.
        self.ttft: tuple | None = None
        self.ttft_start: tuple | None = None
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


class ReplicaLostError(EngineShutdownError):
    """The engine core (replica) running this request died; the server restarts it and keeps serving
    on the others (HTTP 503: the client may retry)."""


def start_core(config, index: int, visible_devices: str | None) -> CorePlacement:
    """Starts replica `index`'s engine core: a process of this host, or a Ray actor on a node of the
    cluster with --data-parallel-backend ray (its sockets then tcp:// on this host's address)."""
    if config.parallel.data_parallel_backend == "ray":
        from splitserve.executor.ray_ranks import connect, import_ray
        connect(config.parallel.ray_address)
        placement = CorePlacement(tcp_host=import_ray().util.get_node_ip_address())
        try:
            placement.start_ray_actor(config, index)
        except BaseException:
            placement.close()
            raise
        return placement
    placement = CorePlacement()
    try:
        placement.start_process(config, visible_devices)
    except BaseException:
        placement.close()
        raise
    return placement


class AsyncLLMEngine:
    def __init__(self, engine=None, max_queued_requests: int | None = None,
                 on_output: Callable[[RequestStream, RequestOutput, float], None] | None = None, *,
                 front=None, replicas: list[Replica] | None = None):
        """`engine`: an LLMEngine whose core this object drives on a thread. (`launch` builds the
        other placement, the cores in processes of their own, and passes `front` and `replicas`.)"""
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        if replicas is None:
            placement = CorePlacement()
            placement.thread = threading.Thread(target=self._run_core_thread, args=(engine.core, placement),
                                                name="splitserve-engine-core", daemon=True)
            front = engine.front
            replicas = [Replica(0, placement)]
        self.engine = engine if engine is not None else front  # tokenizer, config, model name, validation
        self.front = front
        self.max_queued_requests = max_queued_requests
        # Called on the loop thread for every output with the engine-side timestamp (for metrics).
        self.on_output = on_output
        # Called on the loop thread once if the core dies without saying why (the server exits).
        # With several replicas a dead one is restarted instead, and this is not called.
        self.on_core_lost: Callable[[], None] | None = None
        # Called on the loop thread with the token count of each engine step (for metrics).
        self.on_step_tokens: Callable[[list[int]], None] | None = None
        self.replicas = replicas
        self._router = None if len(replicas) == 1 else ReplicaRouter(
            len(replicas), front.config.cache.block_size, front.config.scheduler.max_num_seqs)
        self._to_core = Codec(FrontToCore)
        self._send_lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._dead: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}   # loop thread only
        self._replica_of: dict[str, Replica] = {}      # request id -> the replica running it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._max_running = front.config.scheduler.max_num_seqs
        self._ready_timeout: float | None = None
        self._config = front.config      # what a replica that died is restarted with
        self._restarts: list[threading.Thread] = []  # threads restarting replicas (joined at shutdown)
        self._ttft = ttft_enabled()  # the per-request TTFT breakdown (SPLITSERVE_TTFT_LOG)

    @staticmethod
    def _run_core_thread(core, placement: CorePlacement) -> None:
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
        """Starts the engine core(s) in processes of their own (one per data-parallel replica) and
        builds the front here meanwhile."""
        from splitserve.engine.front import EngineFront, build_front_mm_processor, load_front_tokenizer
        config = args.create_engine_config()  # bad arguments fail here, before any process starts
        devices = replica_devices(config)     # so do GPUs too few for the replicas
        replicas: list[Replica] = []
        try:
            for i, dev in enumerate(devices):
                placement = start_core(config, i, dev)
                replicas.append(Replica(i, placement, dev))
            tokenizer = load_front_tokenizer(config)
            mm_processor = build_front_mm_processor(config, tokenizer)
            for r in replicas:
                ready = r.placement.wait_ready(ready_timeout)
                r.num_blocks = ready.num_blocks
            front = EngineFront(config, tokenizer, min(r.num_blocks for r in replicas), ready.block_size,
                                mm_processor, stream_interval)
        except BaseException:
            for r in replicas:
                r.placement.kill()
                r.placement.close()
            raise
        logger.info("engine core process(es) %s ready", ", ".join(str(r.placement.pid) for r in replicas))
        engine = cls(max_queued_requests=max_queued_requests, front=front, replicas=replicas)
        engine._ready_timeout = ready_timeout
        return engine

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Binds to the running event loop and starts the core thread (if any) and the receivers
        (idempotent)."""
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        for r in self.replicas:
            if r.placement.thread is not None:
                r.placement.thread.start()
            self._start_receiver(r)

    def _start_receiver(self, replica: Replica) -> None:
        loop = self._loop

        def on_message(r: Replica, msg: EngineCoreOutputs) -> None:
            loop.call_soon_threadsafe(self._on_core_outputs, r, msg)

        def on_gone(r: Replica, placement: CorePlacement, why: str) -> None:
            loop.call_soon_threadsafe(self._on_core_gone, r, placement, why)

        replica.start_receiver(on_message, on_gone, lambda: self._stopping)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts whatever is left, stops the cores and waits for them (off the loop)."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self.abort_all()
        loop = asyncio.get_running_loop()
        for r in self.replicas:
            if r.placement.alive():
                self._send(r, Shutdown())
        for t in self._restarts:  # a restart in progress gives up (and stops what it started)
            await loop.run_in_executor(None, t.join, timeout)
        for r in self.replicas:
            await loop.run_in_executor(None, r.placement.join, timeout)
            await loop.run_in_executor(None, r.join_receiver, timeout)
            r.placement.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    @property
    def core_pid(self) -> int | None:
        return self.core_pids[0]

    @property
    def core_pids(self) -> list[int | None]:
        """Each replica's engine core process id (None: a core on a thread)."""
        return [r.placement.pid for r in self.replicas]

    @property
    def stats(self) -> SchedulerStats:
        """The cores' last counters, summed over the replicas. Loop thread only."""
        return total_stats(self.replicas)

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
        """Sequences that will wait for a place in a running batch once `num_new` more arrive (at
        the least busy replica), counted in sequences (a request with n=4 is 4), the unit the cores
        queue. Loop thread only: the replicas' stats are replaced there."""
        queued = [r.queued_with(0, self._max_running) for r in self.replicas]
        if num_new:
            up = [r for r in self.replicas if r.up] or self.replicas
            best = min(up, key=lambda r: r.queued_with(num_new, self._max_running))
            queued[best.index] = best.queued_with(num_new, self._max_running)
        return sum(queued)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def replica_health(self) -> list[dict]:
        return [r.health() for r in self.replicas]

    # -- requests ---------------------------------------------------------------------------------
    def _send(self, replica: Replica, msg) -> None:
        self._send_bytes(replica, self._to_core.encode(msg), type(msg).__name__)

    def _send_bytes(self, replica: Replica, data: bytes, what: str = "AddRequests") -> None:
        if not replica.up or (self._dead is not None and not replica.placement.alive()):
            return  # nobody to tell
        with self._send_lock:
            try:
                replica.placement.input.send(data)
            except (zmq.Again, zmq.ZMQError):  # the core is gone; its loss is reported elsewhere
                logger.warning("could not send %s to engine core %d", what, replica.index)

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
        replica = self._route(core_requests[0])
        stream = RequestStream(request_id, core_requests[0].arrival_time)
        self._streams[request_id] = stream
        self._replica_of[request_id] = replica
        replica.requests.add(request_id)
        replica.num_routed += 1
        replica.num_sent += len(core_requests)
        replica.num_seqs_in_flight += len(core_requests)
        stream.num_seqs = len(core_requests)
        self._send_bytes(replica, data)
        return stream

    def _route(self, request) -> Replica:
        if len(self.replicas) == 1:
            return self.replicas[0]
        lora = request.lora_request
        hashes = self._router.block_hashes(request.prompt_token_ids, None if lora is None else lora.lora_int_id)
        loads = [self._router.load(r.num_seqs_in_flight, r.stats.kv_usage) if r.up else None for r in self.replicas]
        try:
            return self.replicas[self._router.choose(hashes, loads)]
        except RuntimeError as e:
            self.front.output_processor.abort(request.request_id)
            raise EngineShutdownError(f"{e}: every replica is restarting; retry later") from None

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
        replica = self._replica_of.get(request_id)
        if seq_ids and replica is not None:
            self._send(replica, AbortRequests(seq_ids))
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

    # -- loop-thread side -------------------------------------------------------------------------
    def _on_core_outputs(self, replica: Replica, msg: EngineCoreOutputs) -> None:
        if not replica.up:
            return  # a message of a core that is gone and being replaced
        replica.stats = msg.stats
        if msg.step_tokens and self.on_step_tokens is not None:
            try:
                self.on_step_tokens(msg.step_tokens)
            except Exception:  # metrics must never break serving
                logger.exception("step observer failed")
        if msg.outputs:
            if self._ttft:
                self._take_ttft_traces(msg)
            outputs, drop = self.front.output_processor.process(msg.outputs, msg.timestamp)
            for reason, ids in drop.items():
                self._send(replica, AbortRequests(ids, reason))
            self._dispatch(outputs, msg.timestamp)
        if msg.dead is not None and msg.process_lost and len(self.replicas) == 1:
            # A rank is gone: the core exits after this message; fail everything now and exit (503 meanwhile).
            self._on_core_gone(replica, replica.placement, f"the engine lost a process: {msg.dead}")
        elif msg.dead is not None and len(self.replicas) > 1:
            self._replace_replica(replica, replica.placement, f"engine core {replica.index} gave up: {msg.dead}")
        elif msg.dead is not None and self._dead is None:
            # The core gave up (steps keep failing): new requests get 503, /health turns 503, and the
            # server stays up to say so.
            from splitserve.core.engine_core import EngineDeadError
            self._dead = EngineDeadError(msg.dead)
            self._fail(list(self._streams), self._dead)

    def _take_ttft_traces(self, msg: EngineCoreOutputs) -> None:
        """Keeps the core's trace of each first token on its stream (the server writes the line once
        the first event is out); the first of a request's n sequences counts."""
        now = time.monotonic()
        for o in msg.outputs:
            if o.ttft_trace is not None:
                stream = self._streams.get(o.request_id) or self._streams.get(o.request_id.rpartition("#")[0])
                if stream is not None and stream.ttft is None:
                    stream.ttft = (o.ttft_trace, msg.timestamp, now)

    def _on_core_gone(self, replica: Replica, placement: CorePlacement, why: str) -> None:
        if placement is not replica.placement:
            return  # an old core's receiver, after the replica was replaced
        if len(self.replicas) > 1:
            self._replace_replica(replica, placement, why)
            return
        if self._dead is not None:
            return
        logger.error("%s; failing %d request(s) in flight", why, len(self._streams))
        from splitserve.core.engine_core import EngineDeadError
        self._dead = EngineDeadError(why)
        self._fail(list(self._streams), self._dead)
        if self.on_core_lost is not None:
            self.on_core_lost()

    def _replace_replica(self, replica: Replica, placement: CorePlacement, why: str) -> None:
        """A replica's core died or gave up: fail its requests (the others keep serving) and start
        a new core in its place, on the same devices, off the loop."""
        if not replica.up or self._stopping:
            return
        replica.up = False
        replica.last_error = why
        ids = list(replica.requests)
        logger.error("engine core %d: %s; failing its %d request(s), restarting it", replica.index, why, len(ids))
        self._fail(ids, ReplicaLostError(f"engine replica {replica.index} failed ({why}); retry the request"))
        if self._router is not None:
            self._router.forget(replica.index)
        thread = threading.Thread(target=self._restart, args=(replica, placement), daemon=True,
                                  name=f"splitserve-core-restart-{replica.index}")
        self._restarts.append(thread)
        thread.start()

    def _restart(self, replica: Replica, old: CorePlacement) -> None:
        """On a thread of its own: the old core is made sure dead, then a new one is started and
        awaited, with a growing pause between failed attempts."""
        old.kill()
        old.join(5)
        old.close()
        delay = 1.0
        while not self._stopping:
            placement = None
            try:
                placement = self._start_core_on_loop(replica)
                ready = placement.wait_ready(self._ready_timeout, lambda: self._stopping)
            except Exception as e:
                if self._stopping:
                    if placement is not None:
                        placement.kill()
                        placement.close()
                    return
                logger.error("engine core %d did not restart: %s; retrying in %.0f s", replica.index, e, delay)
                if placement is not None:
                    placement.kill()
                    placement.close()
                replica.last_error = str(e)
                deadline = time.monotonic() + delay
                while time.monotonic() < deadline and not self._stopping:
                    time.sleep(0.1)
                delay = min(delay * 2, 30.0)
                continue
            try:
                self._loop.call_soon_threadsafe(self._on_restarted, replica, placement, ready.num_blocks)
            except RuntimeError:  # the loop is closed
                placement.kill()
                placement.close()
            return

    def _start_core_on_loop(self, replica: Replica) -> CorePlacement:
        """Starts a core process from the event loop's thread and returns its placement. Not from
        the restart thread: the kernel's parent-death signal (process_lifetime.die_with_parent)
        follows the *thread* that started the child, and a restart thread ends soon after."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def start() -> None:
            try:
                placement = start_core(self._config, replica.index, replica.visible_devices)
            except BaseException as e:
                done.set_exception(e)
                return
            done.set_result(placement)

        self._loop.call_soon_threadsafe(start)
        return done.result(timeout=60)

    def _on_restarted(self, replica: Replica, placement: CorePlacement, num_blocks: int) -> None:
        if self._stopping:
            placement.kill()
            placement.close()
            return
        replica.placement = placement
        replica.num_blocks = num_blocks
        replica.stats = SchedulerStats()
        replica.num_sent = replica.num_seqs_in_flight = 0
        replica.requests.clear()
        replica.restarts += 1
        replica.up = True
        self._start_receiver(replica)
        logger.info("engine core %d is back (process %s)", replica.index, placement.pid)

    def _dispatch(self, outputs: list[RequestOutput], ts: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream.engine_done = True
                self._forget(out.request_id)
            self._observe(stream, out, ts)
            if any(o.finish_reason == "error" for o in out.outputs):
                # The core's reason when it gave one (a failed KV load under policy "fail", say).
                why = next((o.stop_reason for o in out.outputs if isinstance(o.stop_reason, str)), None)
                stream._put(EngineRequestError("the engine failed while running this request"
                                               + (f": {why}" if why else "")))
            else:
                stream._put(out)

    def _forget(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        replica = self._replica_of.pop(request_id, None)
        if replica is not None and request_id in replica.requests:
            replica.requests.discard(request_id)
            replica.num_seqs_in_flight -= stream.num_seqs if stream is not None else 1

    def _observe(self, stream: RequestStream, out: RequestOutput, ts: float) -> None:
        if self.on_output is not None:
            try:
                self.on_output(stream, out, ts)
            except Exception:  # metrics must never break serving
                logger.exception("output observer failed")

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        ts = time.monotonic()
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            out, _ = self.front.output_processor.abort(rid, "error")
            self._forget(rid)
            stream.engine_done = True
            if out is not None:  # the observer sees every request end, these too (metrics: "error")
                self._observe(stream, out, ts)
            stream._put(exc if isinstance(exc, ReplicaLostError) else EngineShutdownError(f"the engine stopped: {exc}"))
