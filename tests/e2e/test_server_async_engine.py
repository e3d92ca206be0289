"""AsyncLLMEngine against a fake synchronous engine (no model, so these run in milliseconds):
streams, abort on cancellation, the queue limit, engine errors failing requests but not the
front, and an idle engine thread that sleeps instead of spinning."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from splitserve.engine.async_engine import (AsyncLLMEngine, EngineOverloadedError, EngineRequestError,
                                            EngineShutdownError)
from splitserve.engine.output_processor import CompletionOutput, RequestOutput
from splitserve.sampling_params import SamplingParams


class FakeEngine:
    """One token per step per request; runs at most `max_running` requests, the rest wait."""

    def __init__(self, max_running: int = 8, step_s: float = 0.002):
        self.states: dict[str, dict] = {}
        self.max_running = max_running
        self.step_s = step_s
        self.steps = 0
        self.idle_checks = 0
        self.fail_next_step = False
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()

    def tokenize_prompt(self, prompt):
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return [ord(c) for c in prompt]
        return list(prompt)

    def validate(self, ids, params):
        if params.max_tokens and len(ids) + params.max_tokens > 10_000:
            raise ValueError("too long")

    def add_request(self, rid, prompt, params, arrival_time=None):
        self.thread_ids.add(threading.get_ident())
        self.states[rid] = {"prompt": list(prompt), "out": [], "max": params.max_tokens}

    def abort_request(self, ids):
        ids = [ids] if isinstance(ids, str) else list(ids)
        outs = []
        for rid in ids:
            st = self.states.pop(rid, None)
            if st is not None:
                self.aborted.append(rid)
                outs.append(self._output(rid, st, "abort"))
        return outs

    def has_unfinished_requests(self):
        self.idle_checks += 1
        return bool(self.states)

    @property
    def running(self):
        return list(self.states)[:self.max_running]

    @property
    def num_running(self):
        return len(self.running)

    @property
    def num_waiting(self):
        return max(0, len(self.states) - self.max_running)

    def kv_usage(self):
        return 0.1 * self.num_running

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
            st["out"].append(len(st["out"]))
            done = len(st["out"]) >= st["max"]
            if done:
                del self.states[rid]
            outs.append(self._output(rid, st, "length" if done else None))
        return outs

    @staticmethod
    def _output(rid, st, reason):
        new = st["out"][-1:]
        co = CompletionOutput(index=0, text="x" * len(st["out"]), token_ids=list(st["out"]), finish_reason=reason,
                              delta_text="x" if new else "", delta_token_ids=new)
        return RequestOutput(rid, None, st["prompt"], [co], finished=reason is not None)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_generate_streams_outputs_off_the_loop_thread():
    async def main():
        fake = FakeEngine()
        eng = AsyncLLMEngine(fake)
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
        eng = AsyncLLMEngine(FakeEngine())
        with pytest.raises(ValueError):
            eng.add_request("a", "", SamplingParams())
        with pytest.raises(ValueError):
            eng.add_request("b", "x" * 9999, SamplingParams(max_tokens=5))
        assert eng.num_in_flight == 0 and eng.num_queued == 0
        await eng.shutdown()
    run(main())


def test_cancel_and_early_exit_abort_the_request():
    async def main():
        fake = FakeEngine(step_s=0.01)
        eng = AsyncLLMEngine(fake)

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
        for _ in range(200):
            if not fake.states and eng.num_in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert sorted(fake.aborted) == ["cancelled", "early"]
        assert not fake.states and eng.num_in_flight == 0 and eng.stats.kv_usage == 0
        await eng.shutdown()
    run(main())


def test_queue_limit_raises_overloaded():
    async def main():
        fake = FakeEngine(max_running=1, step_s=0.005)
        eng = AsyncLLMEngine(fake, max_queued_requests=2)
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
        eng.add_request("r4", "hi", SamplingParams(max_tokens=1))  # room again
        await eng.shutdown()
    run(main())


def test_engine_error_fails_requests_not_the_front():
    async def main():
        fake = FakeEngine(step_s=0.01)
        eng = AsyncLLMEngine(fake)
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
        fake = FakeEngine()
        eng = AsyncLLMEngine(fake)
        [o async for o in eng.generate("hi", SamplingParams(max_tokens=2), "r")]
        await asyncio.sleep(0.05)
        steps, checks = fake.steps, fake.idle_checks
        await asyncio.sleep(0.3)
        assert fake.steps == steps and fake.idle_checks == checks  # parked on the condition
        outs = [o async for o in eng.generate("hi", SamplingParams(max_tokens=2), "wake")]
        assert outs[-1].finished  # and a new request wakes it
        await eng.shutdown()
    run(main())


def test_unschedulable_work_does_not_spin():
    """Work the engine cannot schedule yet (steps that do nothing) is retried with a backoff."""
    async def main():
        fake = FakeEngine(max_running=0, step_s=0)
        eng = AsyncLLMEngine(fake)
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
        fake = FakeEngine(step_s=0.01)
        eng = AsyncLLMEngine(fake)
        stream = eng.add_request("r", "hi", SamplingParams(max_tokens=1000))
        await asyncio.sleep(0.05)
        await eng.shutdown()
        outs = [o async for o in stream]
        assert outs[-1].outputs[0].finish_reason == "abort" and not fake.states
    run(main())
