"""`LLM(data_parallel_size=N)`: the server's data-parallel engine (AsyncLLMEngine.launch: N engine
core processes, routing, restarts) driven by the offline API's blocking calls.

The async engine runs on an event loop of its own thread; this object offers the few calls `LLM`
makes of an `LLMEngine` (add_request, step, abort_request, has_unfinished_requests and the front's
tokenizer and validation), so `LLM.generate` and `LLM.chat` work unchanged. Only finished outputs
come back (offline use asks for nothing else).
"""
from __future__ import annotations

import asyncio
import queue
import threading

from splitserve.engine.async_engine import AsyncLLMEngine, EngineShutdownError
from splitserve.engine.front import FrontView
from splitserve.engine.output_processor import RequestOutput
from splitserve.sampling_params import SamplingParams


class ReplicatedLLMEngine(FrontView):
    def __init__(self, args):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="splitserve-dp-loop", daemon=True)
        self._thread.start()
        try:
            # Built on the loop's thread: the cores' parent-death signal follows the thread that
            # starts them (restarts start from there too), and that thread lives as long as we do.
            self.engine = self._call(lambda: AsyncLLMEngine.launch(args))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        self.front = self.engine.front
        self._done: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        self._pending: set[str] = set()

    def _call(self, fn):
        """Runs fn() on the loop thread and returns its result (raises what it raised)."""
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    stream: bool = False, lora_request=None, priority: int = 0) -> str:
        params = params or SamplingParams(**self.sampling_defaults)

        def add() -> str:
            s = self.engine.add_request(request_id, prompt, params, lora_request=lora_request, priority=priority)
            self._loop.create_task(self._collect(s))
            return s.request_id
        rid = self._call(add)
        self._pending.add(rid)
        return rid

    async def _collect(self, stream) -> None:
        last = None
        try:
            async for out in stream:
                last = out
        except EngineShutdownError as e:  # its replica died: the request fails, the others go on
            self._done.put(RuntimeError(f"request {stream.request_id}: {e}"))
            return
        except BaseException as e:
            self._done.put(e)
            return
        self._done.put(last)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Blocks until at least one request has finished; returns every one finished by then."""
        outs = [self._done.get()]
        while True:
            try:
                outs.append(self._done.get_nowait())
            except queue.Empty:
                break
        for o in outs:
            if isinstance(o, BaseException):
                self._pending.clear()
                raise o
            self._pending.discard(o.request_id)
        return outs

    def abort_request(self, request_ids) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.engine.abort(rid)  # safe from any thread
            self._pending.discard(rid)
        return []

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.engine.shutdown(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
