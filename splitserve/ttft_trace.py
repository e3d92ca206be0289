"""Per-request TTFT breakdown: where the time from a request's arrival to its first streamed event goes.

Off unless `SPLITSERVE_TTFT_LOG=FILE` is set (in the server's environment; the engine core process
inherits it). Then each streamed request writes one JSON line to FILE when its first token event has
been sent to the client; `benchmarks/ttft_breakdown.py` summarizes a log (the slowest 1% and where
their time went). Off, the only cost is an `is None` test per step and per output.

The timestamps are `time.monotonic()` (one system-wide clock, so the front's and the core's process
compare directly), gathered where the request passes:

    handler  the HTTP handler starts (the body is parsed; the prompt is not tokenized yet)   front
    arrival  the front hands it to a core (tokenized, validated: EngineCoreRequest.arrival_time)
    recv     the core loop takes it in (after the step that was running when it came)         core
    per step that ran part of its prompt (a chunk): schedule start, schedule end, launched,
             collected (its tokens on the host), its tokens, the step's tokens, and its device time
             (collected less the later of its launch and the previous step's collection)
    sent     the core's message with its first token leaves (EngineCoreOutputs.timestamp)
    front    the front's loop takes that message in                                        front
    first    its first event has been written to the client

and GC pauses (wall time between gc.callbacks' start and stop, GIL waits included; those over 10 ms
are also logged, with their CPU time) in the core between recv and its first token and in the front
between handler and first, and Triton kernel compiles (each one is also logged: after start-up a compile is
a stall that a warm-up missed) and CUDA caching-allocator retries (a cudaFree and retry) in the core
meanwhile. The components of a line (ms) add up to `total`:

    front      handler -> arrival: tokenize, template, validation
    to_core    arrival -> recv: IPC, and the step the core was busy with when it came
    wait       recv -> the schedule that first admits it: waiting in the scheduler's queue
    schedule   that schedule -> its launch: scheduling, input layout, launch (on a CPU, where a
               launch runs the step, the forward too)
    ahead      launch -> its first step starts on the device: the step launched before it (async
               scheduling keeps one step queued on the device)
    prefill    its chunks' steps' device time (chunks and step tokens are in the line)
    gaps       between its chunks, and between its last chunk's end and collection
    core_out   collected -> the core's message leaves: update, outputs, encoding
    to_front   message -> the front's loop: ZeroMQ, the receiver thread, a busy event loop
    output     -> first event written: detokenization, stream queue, SSE serialization
"""
from __future__ import annotations

import gc
import json
import logging
import os
import time

logger = logging.getLogger(__name__)

ENV = "SPLITSERVE_TTFT_LOG"
# Set (to anything): this branch's TTFT changes are off (prefill sharing in the scheduler, the front's
# gc.freeze), so one lease can measure before and after (benchmarks/ttft_breakdown.sh AB=1).
BASELINE_ENV = "SPLITSERVE_TTFT_BASELINE"

COMPONENTS = ("front", "to_core", "wait", "schedule", "ahead", "prefill", "gaps", "core_out", "to_front", "output")


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def baseline() -> bool:
    return bool(os.environ.get(BASELINE_ENV))


# -- GC pauses ------------------------------------------------------------------------------------
_gc_total = 0.0
_gc_start = _gc_cpu_start = 0.0
_gc_hooked = False
_LONG_GC_S = 0.01
_long_gcs: list[tuple[int, float, float]] = []  # (generation, wall s, CPU s) of long ones not yet logged


def _on_gc(phase: str, info: dict) -> None:
    # Wall time from the collector's start to its stop callback: the collection, finalizers, and
    # any wait for the GIL in between (another thread may run then); thread CPU time tells them apart.
    global _gc_total, _gc_start, _gc_cpu_start
    if phase == "start":
        _gc_start, _gc_cpu_start = time.perf_counter(), time.thread_time()
    else:
        dt = time.perf_counter() - _gc_start
        _gc_total += dt
        if dt > _LONG_GC_S and len(_long_gcs) < 100:  # logged later, outside the collector
            _long_gcs.append((info.get("generation", -1), dt, time.thread_time() - _gc_cpu_start))


def log_long_gcs(where: str) -> None:
    """Logs the GC pauses over 10 ms since the last call (a stall of everything on this process)."""
    while _long_gcs:
        gen, dt, cpu = _long_gcs.pop(0)
        logger.warning("%s: a garbage collection (generation %d) took %.0f ms (%.0f ms of this thread's CPU)",
                       where, gen, dt * 1e3, cpu * 1e3)


def gc_clock() -> float:
    """Seconds this process has spent in garbage collection since the hook went in (installed by
    the first call)."""
    global _gc_hooked
    if not _gc_hooked:
        gc.callbacks.append(_on_gc)
        _gc_hooked = True
    return _gc_total


# -- kernel compiles while serving ------------------------------------------------------------------
_compile_total = 0.0
_compile_start: dict[str, float] = {}


def _before_compile(*, key, repr, **_):
    _compile_start[str(key)] = time.perf_counter()
    return None  # (a true value would skip the compile)


def _after_compile(*, key, repr, **_):
    global _compile_total
    t = _compile_start.pop(str(key), None)
    if t is not None:
        dt = time.perf_counter() - t
        _compile_total += dt
        logger.warning("a Triton kernel compiled while serving (%.0f ms): %s", dt * 1e3, repr[:300])
    return None


def hook_kernel_compiles() -> None:
    """Times (and logs) every Triton JIT compile from now on: after start-up one is a stall of a step
    (tens to hundreds of ms) that a warm-up or the precompile missed. Leaves hooks others set alone."""
    try:
        from triton import knobs
    except Exception:  # no Triton (CPU-only torch), or one without knobs
        return
    rt = knobs.runtime
    if rt.jit_cache_hook is None and rt.jit_post_compile_hook is None:
        rt.jit_cache_hook, rt.jit_post_compile_hook = _before_compile, _after_compile


def compile_clock() -> float:
    return _compile_total


def alloc_retries() -> int:
    """How often the CUDA caching allocator has had to free its cache and retry a cudaMalloc (a
    synchronizing stall of the step that asked) in this process; 0 without CUDA."""
    import torch  # (the core's side only: the front never asks)
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


# -- the core's side --------------------------------------------------------------------------------
class StepTimes:
    """One launched step's host timestamps, shared by the traces of the requests it ran chunks of."""
    __slots__ = ("t_sched", "t_sched_end", "t_launched", "t_collected", "tokens", "device")

    def __init__(self, t_sched: float, t_sched_end: float, tokens: int):
        self.t_sched, self.t_sched_end, self.tokens = t_sched, t_sched_end, tokens
        self.t_launched = self.t_collected = self.device = 0.0


class CoreTracer:
    """The engine core's recorder (EngineCore.ttft is one of these, or None when off)."""

    def __init__(self):
        self.last_collected = 0.0
        self.steps: dict[int, StepTimes] = {}  # launched, not collected: step id -> times
        gc_clock()
        hook_kernel_compiles()

    def on_add(self, request) -> None:
        log_long_gcs("engine core")
        # then one (StepTimes, tokens) per chunk
        request.ttft_trace = [time.monotonic(), gc_clock(), compile_clock(), alloc_retries()]

    def on_schedule(self, sched, t_sched: float, requests: dict) -> None:
        """After the schedule: the step's record, and a chunk for each request still in its prompt."""
        if sched.is_empty:
            return
        st = StepTimes(t_sched, time.monotonic(), sched.total_num_scheduled_tokens)
        self.steps[sched.step_id] = st
        if len(self.steps) > 64:  # steps that failed and were never collected
            for k in sorted(self.steps)[:-8]:
                del self.steps[k]
        for rid, n in sched.num_scheduled_tokens.items():
            r = requests.get(rid)
            trace = getattr(r, "ttft_trace", None)
            if trace is not None and r.num_computed_tokens < r.num_prompt_tokens:
                trace.append((st, n))

    def on_launched(self, sched) -> None:
        st = self.steps.get(sched.step_id)
        if st is not None:
            st.t_launched = time.monotonic()

    def on_collected(self, sched) -> None:
        st = self.steps.pop(sched.step_id, None)
        now = time.monotonic()
        if st is not None:
            st.t_collected = now
            st.device = now - max(st.t_launched, self.last_collected)
        self.last_collected = now

    @staticmethod
    def first_token(request) -> list[float] | None:
        """The flat trace that rides the request's first output (EngineCoreOutput.ttft_trace):
        recv, GC and kernel-compile seconds and allocator retries since recv, then per chunk its
        step's five times and two token counts."""
        trace = getattr(request, "ttft_trace", None)
        if trace is None:
            return None
        request.ttft_trace = None
        out = [trace[0], gc_clock() - trace[1], compile_clock() - trace[2], float(alloc_retries() - trace[3])]
        for st, n in trace[4:]:
            out += [st.t_sched, st.t_sched_end, st.t_launched, st.t_collected, st.device, float(n), float(st.tokens)]
        return out


# -- the front's side -------------------------------------------------------------------------------
_HEAD, _CHUNK = 4, 7  # the core's trace: 4 figures, then 7 per chunk (CoreTracer.first_token)


def breakdown(handler: float, arrival: float, core: list[float], sent: float, front: float, first: float,
              gc_front: float) -> dict:
    """One request's line: the components (ms, summing to total) and the chunks' figures."""
    recv, gc_core, compile_core, retries = core[0], core[1], core[2], core[3]
    chunks = [core[i:i + _CHUNK] for i in range(_HEAD, len(core), _CHUNK)]
    ms = 1e3
    d = {"total": (first - handler) * ms, "front": (arrival - handler) * ms, "to_core": (recv - arrival) * ms}
    if chunks:
        c0, last = chunks[0], chunks[-1]
        start_dev = c0[3] - c0[4]  # the first chunk's step started on the device (collected - its time)
        device = sum(c[4] for c in chunks)
        d.update(wait=(c0[0] - recv) * ms, schedule=(c0[2] - c0[0]) * ms,
                 ahead=max(0.0, start_dev - c0[2]) * ms, prefill=device * ms,
                 gaps=(last[3] - max(start_dev, c0[2]) - device) * ms, core_out=(sent - last[3]) * ms)
    else:  # (no chunk seen: prompt loaded from elsewhere) all core time in one component
        d.update(wait=(sent - recv) * ms, schedule=0.0, ahead=0.0, prefill=0.0, gaps=0.0, core_out=0.0)
    d.update(to_front=(front - sent) * ms, output=(first - front) * ms)
    d["chunks"] = len(chunks)
    d["chunk_tokens"] = [int(c[5]) for c in chunks]
    d["step_tokens"] = [int(c[6]) for c in chunks]
    d["step_ms"] = [round(c[4] * ms, 3) for c in chunks]
    d["gc_core"], d["gc_front"], d["compile_core"] = gc_core * ms, gc_front * ms, compile_core * ms
    d["alloc_retries"] = int(retries)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


class FrontLog:
    """The front's writer: one JSON line per streamed request, at its first event."""

    def __init__(self, path: str):
        # line-buffered: one write per request. (The GC hook goes in with the first request: start-up's
        # collections, the server's own gc.collect before its freeze among them, are not serving's.)
        self.file = open(path, "a", buffering=1)

    def start(self) -> tuple[float, float]:
        """The handler's start (and the front's GC clock then), kept on its streams (ttft_start)."""
        return time.monotonic(), gc_clock()

    def first_event(self, stream) -> None:
        """Writes the line of `stream` (an engine RequestStream) once its first event is out."""
        got, start = stream.ttft, stream.ttft_start
        if got is None or start is None:
            return
        stream.ttft_start = None  # one line per request
        log_long_gcs("server front")
        first = time.monotonic()
        core, sent, front = got
        line = breakdown(start[0], stream.arrival_time, core, sent, front, first, gc_clock() - start[1])
        line["id"] = stream.request_id
        self.file.write(json.dumps(line) + "\n")


def front_log() -> FrontLog | None:
    path = os.environ.get(ENV)
    return FrontLog(path) if path else None
