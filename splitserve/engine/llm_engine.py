"""The synchronous engine: add requests, step, collect outputs. The async server front and the offline
`LLM` class both drive this."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import torch

from splitserve.config import (CacheConfig, CompileConfig, EngineConfig, ModelConfig, ParallelConfig,
                               SchedulerConfig)
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.scheduler import Scheduler
from splitserve.engine.fault_injection import install_step_faults
from splitserve.engine.output_processor import RequestOutput, RequestState
from splitserve.models.loader import load_hf_config, load_model, read_generation_eos, resolve_dtype
from splitserve.models.resolve import load_tokenizer, resolve_model
from splitserve.models.text_config import TextConfig
from splitserve.request import Request, RequestStatus
from splitserve.sampling_params import SamplingParams
from splitserve.startup.bytecode import start_bytecode_warmup
from splitserve.startup.kernel_precompile import start_attention_precompile
from splitserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# A step failure fails that step's requests; this many in a row with no good step between them means
# the device or model is broken for good (a lost GPU fails every step), and the engine gives up.
MAX_FAILED_STEPS_IN_A_ROW = 3


class EngineDeadError(RuntimeError):
    """The engine cannot run steps any more; the server should report itself unhealthy."""


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    device: str | None = None  # None: cuda if available, else cpu
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # None: triton on CUDA, torch_ref on CPU
    enforce_eager: bool = False
    random_weights: bool = False
    async_scheduling: bool | None = None  # overlap host and device work across steps; None: on CUDA
    served_model_name: str | None = None


def _load_tokenizer(source, random_weights: bool):
    try:
        return load_tokenizer(source)
    except (OSError, ValueError):
        if not random_weights:
            raise
        # A bare config for performance runs: any tokenizer will do for token-id prompts.
        logger.warning("no tokenizer next to %s; using the default model's", source.path)
        return load_tokenizer(None)


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        args = args or EngineArgs(**kwargs)
        self.args = args
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        t0 = time.perf_counter()
        source = resolve_model(args.model)
        self.source = source
        self.model_name = args.served_model_name or source.name
        hf_config = load_hf_config(source)
        dtype = resolve_dtype(args.dtype, hf_config, device)
        context = getattr(hf_config, "max_position_embeddings", None) or 2048
        if args.max_model_len is not None and args.max_model_len > context:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's context of {context} tokens")
        max_model_len = args.max_model_len or context
        eos = {hf_config.eos_token_id} if isinstance(hf_config.eos_token_id, int) else set(hf_config.eos_token_id or [])
        eos |= set(read_generation_eos(source))
        backend = args.attention_backend or ("triton" if device.startswith("cuda") else "torch_ref")
        compile_config = CompileConfig(enforce_eager=args.enforce_eager)
        # The compiler stack's Python sources and the attention kernels compile in forked children
        # while the model is built; forked before any thread of ours starts.
        compiles = device.startswith("cuda") and not args.enforce_eager
        bytecode = start_bytecode_warmup() if compiles else None
        precompile = None
        if compiles and backend == "triton":
            precompile = start_attention_precompile(hf_config, dtype, args.block_size, args.max_num_batched_tokens,
                                                    max_model_len, compile_config.decode_graph_sizes(args.max_num_seqs))
        # Requests need the tokenizer, building the model does not. For a config read natively nothing
        # below imports transformers, so the tokenizer (transformers' import is seconds of it) loads on
        # a thread meanwhile; importing transformers from two threads at once is not safe, so other
        # models load it first.
        if isinstance(hf_config, TextConfig):
            pool = ThreadPoolExecutor(1, thread_name_prefix="splitserve-tokenizer")
            tokenizer_future = pool.submit(_load_tokenizer, source, args.random_weights)
            pool.shutdown(wait=False)
        else:
            tokenizer_future = Future()
            tokenizer_future.set_result(_load_tokenizer(source, args.random_weights))
        try:
            logger.info("config loaded in %.1f s", time.perf_counter() - t0)
            t0 = time.perf_counter()
            arch, model = load_model(source, hf_config, dtype, device, args.random_weights)
            logger.info("model built in %.1f s", time.perf_counter() - t0)
            config = EngineConfig(
                model=ModelConfig(hf_config, source.path, arch, dtype, max_model_len, hf_config.vocab_size,
                                  tuple(sorted(eos))),
                cache=CacheConfig(args.block_size, args.gpu_memory_utilization, args.num_blocks,
                                  args.cpu_kv_cache_gib, args.enable_prefix_caching),
                scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_model_len),
                parallel=ParallelConfig(), compile=compile_config,
                device=device, attention_backend=backend)
            self.runner = ModelRunner(config, model)
            num_blocks = self.runner.determine_num_blocks()
            self.runner.allocate_kv_cache(num_blocks)
            if bytecode is not None:
                bytecode.wait(timeout=10.0)  # compiling the model imports what they compile
            self.runner.setup_fast_path()
        except BaseException:
            # A caller that goes on to import transformers must not race the thread doing it.
            futures_wait([tokenizer_future])
            raise
        finally:
            if precompile is not None:
                precompile.finish()
        t0 = time.perf_counter()
        self.tokenizer = tokenizer_future.result()  # re-raises the thread's error, if any
        logger.info("waited %.1f s for the tokenizer", time.perf_counter() - t0)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.config = dataclasses.replace(config, model=dataclasses.replace(config.model, eos_token_ids=tuple(sorted(eos))))
        self.runner.config = self.config
        from splitserve.multimodal.processor import build_mm_processor
        self.mm_processor = build_mm_processor(model, source, self.tokenizer)  # None for text-only models
        install_step_faults(self.runner)  # test-only; a no-op unless SPLITSERVE_INJECT_STEP_FAULTS is set
        self.kv_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_manager)
        self.kv_capacity_tokens = num_blocks * args.block_size
        self.states: dict[str, RequestState] = {}
        # child request id -> (its user request, its slot there): n > 1 fans one request out to n children
        self._children: dict[str, tuple[RequestState, object]] = {}
        self._ids = itertools.count()
        self._failed_steps_in_a_row = 0
        self.async_scheduling = device.startswith("cuda") if args.async_scheduling is None else args.async_scheduling
        self._inflight = None  # the launched step whose results are not processed yet
        # Start-up leaves millions of long-lived objects (modules, compiled graphs, sympy expressions);
        # every full collection while serving would walk them all, stalling a step for ~0.1 s. Freeze
        # them out of the collector's view (what start-up left as garbage stays: a little memory).
        gc.freeze()
        logger.info("engine ready: %s (%s) on %s, %s, backend %s", self.model_name, arch, device, dtype, backend)

    # -- requests --------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if hasattr(prompt, "mm_items"):
            return prompt  # a MultiModalPrompt: expanded ids that carry their images along
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Checks a tokenized request against the model and cache; returns its total-token cap."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        limit = self.config.model.max_model_len
        n = len(prompt_ids)
        if n >= limit:
            raise ValueError(f"prompt has {n} tokens, but the model's context is {limit} tokens "
                             f"(max_model_len), leaving no room for output")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                             f"tokens exceeds the model's context of {limit} tokens")
        total = limit if params.max_tokens is None else n + params.max_tokens
        need = n + (params.max_tokens or 1)  # without max_tokens, output is capped by the cache instead
        if need > self.kv_capacity_tokens:
            raise ValueError(f"request needs {need} tokens of KV cache, but the cache holds only "
                             f"{self.kv_capacity_tokens} tokens")
        return min(total, self.kv_capacity_tokens)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, stream: bool = True) -> str:
        """Queues a request. With stream=False, step() reports it only once it has finished (offline
        use: no per-token output objects)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenize_prompt(prompt)
        total = self.validate(prompt_ids, params)
        arrival = arrival_time or time.monotonic()
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.for_child(i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, prompt_ids, child_params, self.config.model.eos_token_ids,
                                    total, arrival, mm_items=getattr(prompt_ids, "mm_items", ())))
        state = RequestState(request_id, prompt if isinstance(prompt, str) else None, children, self.tokenizer)
        state.stream = stream
        self.states[request_id] = state
        for child, child_state in zip(children, state.children):
            self._children[child.request_id] = (state, child_state)
            self.scheduler.add_request(child)
        return request_id

    def abort_request(self, request_ids) -> list[RequestOutput]:
        """Ends requests wherever they are and frees their blocks; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            state = self.states.get(rid)
            if state is None:
                continue
            self.scheduler.finish_requests([c.request.request_id for c in state.children], RequestStatus.FINISHED_ABORTED)
            outputs.append(self._finish_output(state))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and launches one step, then processes the results of the step before it.

        With async scheduling the host work of step N+1 (scheduling, input layout, launch) overlaps
        the device's work on step N: requests whose tokens from N are still pending are scheduled
        with them as inputs, filled in on the device. A request that N ends (EOS, stop string) wastes
        its slot in N+1, whose token is then discarded. Without it, each step is collected first."""
        outputs = []
        inflight, self._inflight = self._inflight, None
        if inflight is not None and (not self.async_scheduling or inflight.needs_sync):
            outputs += self._process(inflight)
            inflight = None
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            now = time.monotonic()
            for request, _ in sched.scheduled:
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
            try:
                launched = self.runner.launch(sched, inflight)
            except Exception as exc:
                outputs += self._fail_step(sched, exc)
            else:
                self.scheduler.advance(sched, launched.sample_requests)
                self._inflight = launched
        if inflight is not None:
            outputs += self._process(inflight)
        if self._inflight is not None and not self.async_scheduling:
            outputs += self._process(self._inflight)
            self._inflight = None
        return outputs

    def _fail_step(self, sched, exc: Exception) -> list[RequestOutput]:
        """A failed step fails its requests, not the engine (unless steps keep failing)."""
        logger.exception("model step failed; failing its %d requests", len(sched.scheduled))
        failed = {entry[0] for r, _ in sched.scheduled if (entry := self._children.get(r.request_id))}
        for state in failed:
            self.scheduler.finish_requests([c.request.request_id for c in state.children], RequestStatus.FINISHED_ERROR)
        self._failed_steps_in_a_row += 1
        if self._failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise EngineDeadError(f"{self._failed_steps_in_a_row} model steps failed in a row; "
                                  f"last error: {exc}") from exc
        return [self._finish_output(s) for s in failed]

    def _process(self, inflight) -> list[RequestOutput]:
        """Waits for a launched step's tokens; applies them and turns them into request outputs."""
        sched = inflight.sched
        try:
            result = self.runner.collect(inflight)
        except Exception as exc:
            return self._fail_step(sched, exc)
        self._failed_steps_in_a_row = 0
        for rid, entry in result.logprobs.items():
            request = self.scheduler.requests.get(rid)
            if request is not None:
                request.output_logprobs.append(entry)
        updated = self.scheduler.update(sched, result.tokens)
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for request in updated:
            if request.first_token_time is None:
                request.first_token_time = now
            state, child = self._children[request.request_id]
            stop = state.process_tokens(child, 1)
            if stop is not None:
                request.stop_reason = stop
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.finished:
                outputs.append(self._finish_output(state))
            elif state.stream:
                outputs.append(state.make_output())
        return outputs

    def _finish_output(self, state: RequestState) -> RequestOutput:
        out = state.make_output()
        if state.finished:
            self.states.pop(state.request_id, None)
            for c in state.children:
                self._children.pop(c.request.request_id, None)
        return out

    # -- stats -----------------------------------------------------------------------------------
    def kv_usage(self) -> float:
        return self.kv_manager.usage()
