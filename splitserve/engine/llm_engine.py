"""The synchronous engine: the front (tokenizer, validation, output processing) over an engine core
in this process. The offline `LLM` and the terminal chat drive it with `step()`; the server runs the
same front and core classes, with the core in a process of its own (async_engine.py)."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from splitserve.core.engine_core import MAX_FAILED_STEPS_IN_A_ROW, EngineDeadError
from splitserve.engine.front import EngineFront, FrontView, build_front_mm_processor, load_front_tokenizer
from splitserve.engine.output_processor import RequestOutput
from splitserve.engine.args import EngineArgs
from splitserve.executor import build_engine_core
from splitserve.loading.text_config import TextConfig
from splitserve.sampling_params import SamplingParams

__all__ = ["EngineArgs", "EngineDeadError", "LLMEngine", "MAX_FAILED_STEPS_IN_A_ROW"]

logger = logging.getLogger(__name__)


class LLMEngine(FrontView):
    def __init__(self, args: EngineArgs | None = None, stream_interval: int = 1, **kwargs):
        args = args or EngineArgs.from_kwargs("LLMEngine()", **kwargs)
        self.args = args
        t0 = time.perf_counter()
        config = args.create_engine_config()
        logger.info("config loaded in %.1f s", time.perf_counter() - t0)
        # Requests need the tokenizer, building the model does not. For a config read natively nothing
        # below imports transformers, so the tokenizer (transformers' import is seconds of it) loads on
        # a thread meanwhile; importing transformers from two threads at once is not safe, so other
        # models load it first.
        if isinstance(config.model.hf_config, TextConfig):
            pool = ThreadPoolExecutor(1, thread_name_prefix="splitserve-tokenizer")
            tokenizer_future = pool.submit(load_front_tokenizer, config)
            pool.shutdown(wait=False)
        else:
            tokenizer_future = Future()
            tokenizer_future.set_result(load_front_tokenizer(config))
        try:
            self.core = build_engine_core(config)
        except BaseException:
            futures_wait([tokenizer_future])  # a caller that imports transformers next must not race it
            raise
        t0 = time.perf_counter()
        tokenizer = tokenizer_future.result()  # re-raises the thread's error, if any
        logger.info("waited %.1f s for the tokenizer", time.perf_counter() - t0)
        self.core.structured.set_tokenizer(tokenizer)  # the core in this process need not load its own
        self.front = EngineFront(config, tokenizer, self.core.num_blocks, config.cache.block_size,
                                 build_front_mm_processor(config, tokenizer, self.core.executor.model),
                                 stream_interval)
        logger.info("engine ready: %s", self.model_name)

    # -- the core in this process (tests look inside) --------------------------------------------
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_manager(self):
        return self.core.kv_manager

    @property
    def runner(self):
        """The ModelRunner (world size 1; with ranks it is in their processes)."""
        return self.core.executor.runner

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, stream: bool = True, lora_request=None,
                    priority: int = 0) -> str:
        """Queues a request. With stream=False, step() reports it only once it has finished (offline
        use: no per-token output objects). `priority` needs the priority scheduling policy (lower
        runs first)."""
        request_id, core_requests = self.front.new_request(request_id, prompt, params, arrival_time, stream,
                                                           lora_request, priority)
        for req in core_requests:
            self.core.add_request(req)
        return request_id

    def abort_request(self, request_ids) -> list[RequestOutput]:
        """Ends requests wherever they are and frees their blocks; returns their final outputs."""
        outputs = []
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            out, seq_ids = self.front.output_processor.abort(rid)
            self.core.abort_requests(seq_ids)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Requests not finished yet, or a launched step not collected yet (stepping on flushes it, so
        no step is left running over blocks that finished requests gave back)."""
        return self.front.output_processor.has_unfinished() or self.core.has_unfinished_requests()

    @property
    def num_running(self) -> int:
        return len(self.core.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting)

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One core step (see EngineCore.step), its tokens turned into request outputs."""
        outputs, drop = self.front.output_processor.process(self.core.step(), time.monotonic())
        for reason, ids in drop.items():
            self.core.abort_requests(ids, reason)
        return outputs

    def kv_usage(self) -> float:
        return self.core.kv_manager.usage()
