"""The TTFT breakdown's arithmetic (ttft_trace.py) on scripted timestamps, and the core's
recorder driven through a real scheduler: components add up to the total, chunks are counted."""
import gc
import json

import pytest

from splitserve import ttft_trace
from splitserve.ttft_trace import COMPONENTS, CoreTracer, FrontLog, breakdown
from tests.core.test_scheduler import make, req, scheduled


def test_components_of_a_two_chunk_request_add_up():
    # recv at 10; chunk 1: scheduled 11-11.5, launched 12, collected 20 after 6 s on the device (so it
    # started at 14: 2 s behind the step ahead of it); chunk 2: 20-20.5, launched 21, collected 25 (4 s)
    core = [10.0, 0.25, 0.0, 0.0,
            11.0, 11.5, 12.0, 20.0, 6.0, 100.0, 150.0,
            20.0, 20.5, 21.0, 25.0, 4.0, 28.0, 60.0]
    d = breakdown(handler=7.0, arrival=9.0, core=core, sent=25.5, front=26.0, first=27.0, gc_front=0.125)
    ms = 1e3
    assert d["total"] == 20 * ms
    assert abs(sum(d[c] for c in COMPONENTS) - d["total"]) < 1e-6
    assert (d["front"], d["to_core"], d["wait"], d["schedule"]) == (2 * ms, 1 * ms, 1 * ms, 1 * ms)
    assert (d["ahead"], d["prefill"], d["gaps"]) == (2 * ms, 10 * ms, 1 * ms)  # 14..25 = 11 s: 10 on device
    assert (d["core_out"], d["to_front"], d["output"]) == (0.5 * ms, 0.5 * ms, 1 * ms)
    assert d["chunks"] == 2 and d["chunk_tokens"] == [100, 28] and d["step_tokens"] == [150, 60]
    assert d["gc_core"] == 250.0 and d["gc_front"] == 125.0


def test_core_tracer_records_each_prompt_chunk_once(monkeypatch):
    sched, _ = make(budget=16, num_blocks=200)
    tracer = CoreTracer()
    r = req("a", 40)
    sched.add_request(r)
    tracer.on_add(r)
    for _ in range(3):  # 16 + 16 + 8: the third chunk samples
        t = 0.0
        out = sched.schedule()
        tracer.on_schedule(out, t, sched.requests)
        tracer.on_launched(out)
        sampling = [x for x, n in scheduled(sched, out) if x.num_computed_tokens + n == x.num_tokens]
        sched.advance(out)
        tracer.on_collected(out)
        sched.update(out, {x.request_id: 7 for x in sampling})
    trace = CoreTracer.first_token(r)
    assert r.ttft_trace is None and CoreTracer.first_token(r) is None  # taken once
    chunks = [trace[i:i + 7] for i in range(4, len(trace), 7)]
    assert [c[5] for c in chunks] == [16, 16, 8] and all(c[6] == c[5] for c in chunks)
    assert all(c[0] <= c[1] <= c[2] <= c[3] for c in chunks[1:])  # schedule end, launch, collection
    assert not tracer.steps  # every launched step was collected


def test_gc_clock_counts_collections():
    before = ttft_trace.gc_clock()
    garbage = [[] for _ in range(10000)]
    for g in garbage:
        g.append(g)  # cycles, so the collector has work
    del garbage
    gc.collect()
    assert ttft_trace.gc_clock() > before


def test_front_log_writes_one_line_per_stream(tmp_path):
    log = FrontLog(str(tmp_path / "t.jsonl"))

    class Stream:
        request_id, arrival_time = "r1", 1.0
        ttft = ([1.5, 0.0, 0.0, 0.0, 2.0, 2.1, 2.2, 3.0, 0.8, 8.0, 8.0], 3.1, 3.2)
    s = Stream()
    s.ttft_start = (0.5, ttft_trace.gc_clock())
    log.first_event(s)
    log.first_event(s)  # a later event writes nothing
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert d["id"] == "r1" and d["chunks"] == 1 and d["total"] > 2700  # 0.5 -> now (monotonic, > 3.2)
    assert d["front"] == pytest.approx(500.0) and d["to_core"] == pytest.approx(500.0)


def test_kernel_compiles_while_serving_are_timed_and_logged(caplog, monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    ttft_trace.hook_kernel_compiles()
    assert knobs.runtime.jit_cache_hook is ttft_trace._before_compile
    before = ttft_trace.compile_clock()
    # what Triton calls around a compile (runtime/jit.py _do_compile); None: the compile goes ahead
    assert knobs.runtime.jit_cache_hook(key="k", repr="_some_kernel[num_warps=4](M: i32)", fn=None, compile={},
                                        is_manual_warmup=False, already_compiled=False) is None
    knobs.runtime.jit_post_compile_hook(key="k", repr="_some_kernel[num_warps=4](M: i32)", fn=None, compile={},
                                        is_manual_warmup=False, already_compiled=False)
    assert ttft_trace.compile_clock() > before
    assert "compiled while serving" in caplog.text and "_some_kernel" in caplog.text
