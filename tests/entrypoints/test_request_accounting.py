"""Request accounting of the server's metrics, on the real serving code over a fake engine core (no
model, milliseconds): every request handed to the engine is counted in once and out once, under
exactly one reason (stop, length, abort, error, rejected), whichever way it leaves; a request
refused before it reaches the engine is not counted at all. The same check on a real server under
a storm of clients is in tests/e2e/test_server_front.py."""
from __future__ import annotations

import asyncio

import pytest

from splitserve.entrypoints.openai.protocol import APIError, CompletionRequest
from splitserve.entrypoints.openai.serving import OpenAIServing
from splitserve.metrics import FINISH_REASONS, ServerMetrics
from tests.engine.test_async_engine import FakeCore, make_engine


def sample(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        series, _, label_text = head.partition("{")
        if series == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    return None


def counts(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    out = {r: sample(text, "splitserve:request_success_total", finished_reason=r) for r in FINISH_REASONS}
    out["added"] = sample(text, "splitserve:num_requests_added_total")
    return out


def served(core: FakeCore, **engine_kwargs):
    """The server's wiring (as build_app does it) over a fake core."""
    eng = make_engine(core, **engine_kwargs)
    eng.engine = eng.front  # what the server reads the tokenizer and config from (as after launch)
    eng.front.config.model.quantization = None
    metrics = ServerMetrics("fake", lambda: eng.stats)
    eng.on_output = metrics.on_output
    serving = OpenAIServing(eng, "fake")
    serving.metrics = metrics
    return eng, serving, metrics


async def read_events(response, leave_after: int | None = None) -> list[str]:
    """The body of a streaming response as a client reads it; with leave_after=k the client goes
    away after k events (the generator is closed, as Starlette does on a disconnect)."""
    events = []
    body = response.body_iterator
    try:
        async for chunk in body:
            events.append(chunk)
            if leave_after is not None and len(events) >= leave_after:
                break
    finally:
        await body.aclose()
    return events


def idle(eng) -> bool:
    return not eng.num_in_flight and not eng.num_queued and not eng.stats.num_running


async def settle(eng, timeout: float = 10.0) -> None:
    """Waits until no request is in flight and the core says so too: the queue limit reads the
    core's counts, which arrive a little after the front has ended its requests."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not idle(eng) and loop.time() < deadline:
        await asyncio.sleep(0.005)
    assert idle(eng)


def stream_body(max_tokens: int, n: int = 1, prompt="hello") -> CompletionRequest:
    return CompletionRequest(prompt=prompt, max_tokens=max_tokens, n=n, stream=True)


def test_every_exit_is_counted_once_under_one_reason():
    async def main():
        core = FakeCore(max_running=2, step_s=0.002)
        eng, serving, metrics = served(core, max_queued_requests=2)

        # completes: length
        events = await read_events(await serving.create_completion(stream_body(3), None))
        assert events[-1] == "data: [DONE]\n\n"
        # n=2 is one engine request: counted in once and out once (not once per sample)
        await read_events(await serving.create_completion(stream_body(2, n=2), None))
        # two prompts are two engine requests
        await read_events(await serving.create_completion(stream_body(2, prompt=["a", "b"]), None))
        assert counts(metrics) == {"added": 4, "length": 4, "stop": 0, "abort": 0, "error": 0, "rejected": 0}

        # the client leaves mid-stream: abort
        await read_events(await serving.create_completion(stream_body(5000), None), leave_after=2)
        # the client is gone while the headers are still being written (uvicorn's send waits there
        # when the socket's buffer is full): Starlette cancels the response before its body
        # generator ever starts, so only the response itself can end the request: abort
        response = await serving.create_completion(stream_body(5000), None)

        async def gone():
            return {"type": "http.disconnect"}

        async def send(message):
            await asyncio.sleep(0)

        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, gone, send)
        await settle(eng)
        assert counts(metrics)["abort"] == 2

        # refused by the engine: rejected (queue full -> 503; n no server could take -> 400)
        hogs = [await serving.create_completion(stream_body(5000), None) for _ in range(4)]  # 2 run, 2 wait
        with pytest.raises(APIError) as full:
            await serving.create_completion(stream_body(5), None)
        assert full.value.status == 503
        with pytest.raises(APIError) as too_many:
            await serving.create_completion(stream_body(5, n=5), None)
        assert too_many.value.status == 400 and too_many.value.param == "n"
        # refused before the engine (the front's own checks): never counted in
        with pytest.raises(APIError):
            await serving.create_completion(stream_body(5, prompt=""), None)
        with pytest.raises(APIError):
            await serving.create_completion(stream_body(5, prompt=[1] * 20_000), None)
        for hog in hogs:
            await read_events(hog, leave_after=1)
        await settle(eng)
        assert counts(metrics) == {"added": 12, "length": 4, "stop": 0, "abort": 6, "error": 0, "rejected": 2}

        # a failed engine step: error
        core.fail_next_step = True
        events = await read_events(await serving.create_completion(stream_body(50), None))
        assert '"error"' in events[-2]
        # the core lost while requests run: they end as errors too, and what comes after is rejected
        running = await serving.create_completion(stream_body(5000), None)
        eng._on_core_gone(eng.replicas[0], eng.replicas[0].placement, "test: the core is gone")
        events = await read_events(running)
        assert '"error"' in events[-2]
        with pytest.raises(APIError) as dead:
            await serving.create_completion(stream_body(5), None)
        assert dead.value.status == 503
        final = counts(metrics)
        assert final == {"added": 15, "length": 4, "stop": 0, "abort": 6, "error": 2, "rejected": 3}
        assert final["added"] == sum(final[r] for r in FINISH_REASONS)
        await eng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))
