"""The engine core's busy loop, and its two placements: a thread of the caller's process, or a process
of its own (what `splitserve serve` runs, so that HTTP, tokenization and detokenization never share an
interpreter with the scheduler and the model).

Either way the loop talks to the front over two ZeroMQ sockets on an ipc:// address, one msgspec
message per step each way: the front pushes `AddRequests` / `AbortRequests` / `Shutdown`, the loop
pushes `EngineCoreOutputs`. The first message the loop sends is `CoreReady` (or the start-up error).

The core process watches its parent: the kernel kills it when the parent dies (PR_SET_PDEATHSIG),
and the loop also checks the parent's pid whenever it is idle, so no orphan ever holds the GPU. In a
Ray actor (executor/ray_core_host.py) it runs with no parent to watch: Ray ends it with its owner.
"""
from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import zmq

from splitserve.protocol.core_messages import (AbortRequests, AddRequests, Codec, CoreReady, EngineCoreOutput,
                                        EngineCoreOutputs, FrontToCore, SchedulerStats, Shutdown)
from splitserve.process_lifetime import die_with_parent, flush_and_exit

logger = logging.getLogger(__name__)

# How long an idle loop blocks on its input before it looks at its parent again.
_IDLE_POLL_MS = 500
# How long the loop waits for input when it has work but could not schedule any of it.
_BACKOFF_MS = 5


def connect_sockets(ctx: zmq.Context, input_addr: str, output_addr: str) -> tuple[zmq.Socket, zmq.Socket]:
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)  # flush the last outputs on exit
    out.connect(output_addr)
    return inp, out


def run_core_loop(core, inp: zmq.Socket, out: zmq.Socket, parent_pid: int | None = None) -> int:
    """Runs until Shutdown (returns 0) or until the core declares itself dead (returns 1)."""
    from splitserve.core.engine_core import EngineDeadError  # the core module imports torch; keep this one light

    decoder = Codec(FrontToCore)
    encoder = Codec(EngineCoreOutputs)
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    last_stats = None
    backoff = False
    step_tokens: list[int] = []  # of the steps launched since the last message (for the metrics)

    def send(outputs: list[EngineCoreOutput], stats: SchedulerStats, dead: str | None = None,
             process_lost: bool = False) -> None:
        nonlocal last_stats, step_tokens
        out.send(encoder.encode(EngineCoreOutputs(outputs, stats, time.monotonic(), dead, step_tokens,
                                                  process_lost)), copy=False)
        last_stats, step_tokens = stats, []

    def give_up(e: Exception) -> int:
        logger.error("the engine core cannot go on: %s", e, exc_info=not getattr(e, "process_lost", False))
        ids = list(core.scheduler.requests)
        core.abort_requests(ids, "error")
        send([EngineCoreOutput(rid, [], finish_reason="error") for rid in ids], core.stats(), dead=str(e),
             process_lost=getattr(e, "process_lost", False))
        return 1

    while True:
        busy = core.has_unfinished_requests()
        timeout = (_BACKOFF_MS if backoff else 0) if busy else _IDLE_POLL_MS
        stop = False
        if poller.poll(timeout):
            while True:  # everything that has arrived, in order (an abort after its add finds it)
                try:
                    msg = decoder.decode(inp.recv(zmq.NOBLOCK, copy=False).buffer)
                except zmq.Again:
                    break
                if isinstance(msg, AddRequests):
                    for req in msg.requests:
                        core.add_request(req)
                elif isinstance(msg, AbortRequests):
                    core.abort_requests(msg.request_ids, msg.reason)
                elif isinstance(msg, Shutdown):
                    stop = True
        elif not busy and parent_pid is not None and os.getppid() != parent_pid:
            logger.error("the front process is gone; the engine core exits")
            return 1
        elif not busy and hasattr(core, "check_ranks"):
            try:
                if hasattr(core, "idle_work"):  # (test doubles of the core may lack it)
                    core.idle_work()  # blocks held for remote readers, freed when read or at lease end
                core.check_ranks()  # a worker rank that died while idle
            except EngineDeadError as e:
                return give_up(e)
        if stop:
            return 0
        backoff = False
        outputs: list[EngineCoreOutput] = []
        if core.has_unfinished_requests():
            started = time.monotonic()
            try:
                outputs = core.step()
                if getattr(core, "last_step_tokens", 0):  # (test doubles of the core may lack it)
                    step_tokens.append(core.last_step_tokens)
            except EngineDeadError as e:
                return give_up(e)
            except Exception as e:
                # The step failed outside the model call (which fails only its own batch): fail
                # everything in flight and keep serving new requests.
                logger.exception("engine step failed; failing all in-flight requests")
                ids = list(core.scheduler.requests)
                core.abort_requests(ids, "error")
                core.reset_inflight()
                outputs = [EngineCoreOutput(rid, [], finish_reason="error", stop_reason=f"engine step failed: {e}")
                           for rid in ids]
            # A step that produced nothing and took no time scheduled nothing (work it cannot admit
            # yet): wait a little for input instead of spinning on it.
            backoff = not outputs and time.monotonic() - started < 1e-3
        stats = core.stats()
        if outputs or stats != last_stats:
            send(outputs, stats)


# -- the process placement ----------------------------------------------------------------------------
def core_process_main(config, input_addr: str, output_addr: str, parent_pid: int | None, log_level: int,
                      visible_devices: str | None = None) -> int:
    """Entry point of the engine core process (multiprocessing, spawn): it follows parent_pid (the front)
    and exits with the loop's status. parent_pid None: no parent to follow, the caller owns the
    lifetime (a Ray actor, executor/ray_core_host.py: Ray ends it with its owner) and gets the status
    back instead of an exit. `visible_devices`: the CUDA_VISIBLE_DEVICES of a data-parallel replica
    (set before anything touches CUDA; its rank processes inherit it)."""
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    if parent_pid is not None:
        die_with_parent()
        if os.getppid() != parent_pid:  # the parent died before the line above took effect
            os._exit(1)
        # SIGINT goes to the whole process group on Ctrl-C; the front decides when the core stops.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context()
    inp, out = connect_sockets(ctx, input_addr, output_addr)
    ready = Codec(CoreReady)
    dp = config.parallel.data_parallel_size
    if dp > 1 and not config.device.startswith("cuda"):
        # Replicas on the CPU share its cores: each takes its part (more threads only take turns).
        import torch
        from splitserve.cpu_limits import usable_cpus
        torch.set_num_threads(max(1, int(usable_cpus()) // dp))
    try:
        from splitserve.executor import build_engine_core
        core = build_engine_core(config)
    except BaseException as e:
        logger.exception("engine core start-up failed")
        out.send(ready.encode(CoreReady(0, 0, error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")))
        return _leave(ctx, 1, parent_pid)
    out.send(ready.encode(CoreReady(core.num_blocks, core.config.cache.block_size)))
    try:
        code = run_core_loop(core, inp, out, parent_pid)
    finally:
        core.shutdown()  # the worker processes of a multi-rank engine
    inp.close(linger=0)
    return _leave(ctx, code, parent_pid)


def _leave(ctx: zmq.Context, code: int, parent_pid: int | None) -> int:
    if parent_pid is None:  # the last messages leave, and the caller decides what becomes of the process
        ctx.destroy(linger=2000)
        return code
    flush_and_exit(ctx, code)
