"""AsyncLLMEngine with its core loop on a thread, against a fake core (no model, so these run in
milliseconds): streams, abort on cancellation, the queue limit, core errors failing requests but not
the front, and an idle core loop that sleeps instead of spinning. The same loop runs in the server's
core process (tests/e2e/test_engine_process.py)."""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from types import SimpleNamespace

import pytest

from splitserve.engine.async_engine import (AsyncLLMEngine, EngineOverloadedError, EngineRequestError,
                                            EngineShutdownError)
from splitserve.engine.front import EngineFront
from splitserve.protocol.core_messages import EngineCoreOutput, SchedulerStats
from splitserve.engine.output_processor import OutputProcessor
from splitserve.sampling_params import SamplingParams


class FakeTokenizer:
    eos_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 1000 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class FakeFront(EngineFront):
    """The real front (validation, output processor) over a stand-in tokenizer and config."""

    def __init__(self, max_running: int):
        self.source, self.model_name, self.mm_processor = None, "fake", None
        self.tokenizer = FakeTokenizer()
        self.config = SimpleNamespace(model=SimpleNamespace(max_model_len=10_000, vocab_size=1000, eos_token_ids=()),
                                      scheduler=SimpleNamespace(max_num_seqs=max_running))
        self.kv_capacity_tokens = 10_000
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()


class FakeCore:
    """One token per step per sequence; runs at most `max_running` sequences, the rest wait."""

    def __init__(self, max_running: int = 8, step_s: float = 0.002):
        self.states: dict[str, dict] = {}
        self.scheduler = SimpleNamespace(requests=self.states)
        self.max_running = max_running
        self.step_s = step_s
        self.steps = 0
        self.idle_checks = 0
        self.received = 0
        self.fail_next_step = False
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()

    def add_request(self, req):
        self.thread_ids.add(threading.get_ident())
        self.received += 1
        self.states[req.request_id] = {"out": 0, "max": req.sampling_params.max_tokens}

    def abort_requests(self, ids, reason="abort"):
        for rid in ids:
            if self.states.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self):
        self.idle_checks += 1
        return bool(self.states)

    def reset_inflight(self):
        pass

    @property
    def running(self):
        return list(self.states)[:self.max_running]

    def stats(self):
        n = len(self.running)
        return SchedulerStats(num_running=n, num_waiting=len(self.states) - n, kv_usage=0.1 * n,
                              num_received=self.received)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs = []
        for rid in self.running:
            st = self.states[rid]
            st["out"] += 1
            done = st["out"] >= st["max"]
            if done:
                del self.states[rid]
            outs.append(EngineCoreOutput(rid, [st["out"] % 1000], finish_reason="length" if done else None))
        return outs


def make_engine(core: FakeCore, **kwargs) -> AsyncLLMEngine:
    return AsyncLLMEngine(SimpleNamespace(core=core, front=FakeFront(core.max_running)), **kwargs)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_generate_streams_outputs_off_the_loop_thread():
    async def main():
        fake = FakeCore()
        eng = make_engine(fake)
        outs = [o async for o in eng.generate("hi", SamplingParams(max_tokens=5), "r1")]
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert threading.get_ident() not in fake.thread_ids  # the engine never ran on the loop
        # concurrent requests each see only their own outputs
        async def one(i):
            return [o async for o in eng.generate("p", SamplingParams(max_tokens=3 + i), f"c{i}")]
        results = await asyncio.gather(*(one(i) for i in range(6)))
        for i, outs in enumerate(results):
            assert {o.request_id for o in outs} == {f"c{i}"} and len(outs) == 3 + i
        await eng.shutdown()
    run(main())


def test_bad_input_raises_before_queueing():
    async def main():
        eng = make_engine(FakeCore())
        with pytest.raises(ValueError):
            eng.add_request("a", "", SamplingParams())
        with pytest.raises(ValueError):
            eng.add_request("b", "x" * 9999, SamplingParams(max_tokens=5))
        assert eng.num_in_flight == 0 and eng.num_queued == 0
        await eng.shutdown()
    run(main())


def test_cancel_and_early_exit_abort_the_request():
    async def main():
        fake = FakeCore(step_s=0.01)
        eng = make_engine(fake)

        async def consume_two():
            async for o in eng.generate("hi", SamplingParams(max_tokens=1000), "early"):
                if len(o.outputs[0].token_ids) == 2:
                    break  # the async generator is closed: GeneratorExit -> abort
        await consume_two()

        async def forever():
            async for _ in eng.generate("hi", SamplingParams(max_tokens=1000), "cancelled"):
                pass
        task = asyncio.create_task(forever())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the core's stats (KV usage) come with its next message, after the aborts
            if not fake.states and eng.num_in_flight == 0 and eng.stats.kv_usage == 0:
                break
            await asyncio.sleep(0.01)
        assert sorted(fake.aborted) == ["cancelled", "early"]
        assert not fake.states and eng.num_in_flight == 0 and eng.stats.kv_usage == 0
        await eng.shutdown()
    run(main())


def test_queue_limit_raises_overloaded():
    async def main():
        fake = FakeCore(max_running=1, step_s=0.005)
        eng = make_engine(fake, max_queued_requests=2)
        streams = [eng.add_request(f"r{i}", "hi", SamplingParams(max_tokens=1000)) for i in range(2)]
        for _ in range(200):  # r0 runs, r1 waits; room for one more
            if eng.stats.num_running == 1 and eng.stats.num_waiting == 1:
                break
            await asyncio.sleep(0.01)
        streams.append(eng.add_request("r2", "hi", SamplingParams(max_tokens=1000)))
        with pytest.raises(EngineOverloadedError):
            eng.add_request("r3", "hi", SamplingParams(max_tokens=1000))
        for s in streams:
            eng.abort(s.request_id)
        for s in streams:
            outs = [o async for o in s]
            assert outs[-1].outputs[0].finish_reason == "abort"
        for _ in range(200):  # the core's counters follow the aborts one message later
            if eng.stats.num_running == 0 and eng.stats.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        eng.add_request("r4", "hi", SamplingParams(max_tokens=1))  # room again
        await eng.shutdown()
    run(main())


def test_engine_error_fails_requests_not_the_front():
    async def main():
        fake = FakeCore(step_s=0.01)
        eng = make_engine(fake)
        stream = eng.add_request("bad", "hi", SamplingParams(max_tokens=50))
        await asyncio.sleep(0.05)
        fake.fail_next_step = True
        with pytest.raises(EngineRequestError):
            async for _ in stream:
                pass
        outs = [o async for o in eng.generate("hi", SamplingParams(max_tokens=2), "good")]
        assert outs[-1].finished and eng.is_running
        await eng.shutdown()
        with pytest.raises(EngineShutdownError):
            eng.add_request("late", "hi", SamplingParams())
    run(main())


def test_idle_thread_sleeps():
    async def main():
        fake = FakeCore()
        eng = make_engine(fake)
        [o async for o in eng.generate("hi", SamplingParams(max_tokens=2), "r")]
        await asyncio.sleep(0.05)
        steps, checks = fake.steps, fake.idle_checks
        await asyncio.sleep(0.3)
        # parked on its socket: one look a poll interval (0.5 s) at most, where a spinning loop makes thousands
        assert fake.steps == steps and fake.idle_checks - checks <= 2
        outs = [o async for o in eng.generate("hi", SamplingParams(max_tokens=2), "wake")]
        assert outs[-1].finished  # and a new request wakes it
        await eng.shutdown()
    run(main())


def test_unschedulable_work_does_not_spin():
    """Work the engine cannot schedule yet (steps that do nothing) is retried with a backoff."""
    async def main():
        fake = FakeCore(max_running=0, step_s=0)
        eng = make_engine(fake)
        stream = eng.add_request("stuck", "hi", SamplingParams(max_tokens=5))
        await asyncio.sleep(0.3)
        assert 0 < fake.steps < 300  # a spinning thread would make ~10^5 steps here
        eng.abort("stuck")
        outs = [o async for o in stream]
        assert outs[-1].outputs[0].finish_reason == "abort"
        await eng.shutdown()
    run(main())


def test_shutdown_aborts_in_flight_requests():
    async def main():
        fake = FakeCore(step_s=0.01)
        eng = make_engine(fake)
        stream = eng.add_request("r", "hi", SamplingParams(max_tokens=1000))
        await asyncio.sleep(0.05)
        await eng.shutdown()
        outs = [o async for o in stream]
        assert outs[-1].outputs[0].finish_reason == "abort" and not fake.states
    run(main())
