"""The engine core: scheduler + KV-cache manager + model runner, stepping on plain-data requests.

It knows token ids only: no tokenizer, no text, no streams. It takes `EngineCoreRequest`s and
aborts, and each `step()` returns what every sequence gained (`EngineCoreOutput`s). The front (see
llm_engine.py and async_engine.py) turns those into text. The same class runs in two placements:
called directly by the offline engine, or driven by `core_loop.run_core_loop` on a thread or in a
process of its own (the server).
"""
from __future__ import annotations

import functools
import gc
import logging
import time
from dataclasses import dataclass, field

import torch

from splitserve.attention.layer import kv_free_window
from splitserve.config import (CacheConfig, CompileConfig, EngineConfig, ModelConfig, SchedulerConfig,
                               resolve_kv_cache_dtype)
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.protocol.sched_output import GrammarBitmask
from splitserve.core.scheduler import Scheduler
from splitserve.protocol.rank_messages import RanksLostError
from splitserve.fault_injection import install_step_faults
from splitserve.protocol.core_messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from splitserve.engine_args import EngineArgs
from splitserve.loading.generation_config import sampling_defaults
from splitserve.layers.quantization.config import resolve_quant_config
from splitserve.models.families import decoder_spec
from splitserve.loading.hf_config import read_generation_eos, resolve_dtype
from splitserve.models.loader import load_hf_config, load_model
from splitserve.models.registry import get_model_class
from splitserve.loading.resolve import ModelSource, load_serving_tokenizer, resolve_model
from splitserve.core.request import Request, RequestStatus
from splitserve.startup.bytecode import start_bytecode_warmup
from splitserve.startup.kernel_precompile import start_attention_precompile
from splitserve.structured_output.manager import StructuredOutputManager
from splitserve.structured_output.process_manager import GrammarProcessManager
from splitserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How long a step that can schedule nothing waits for a grammar compile before it returns.
_COMPILE_WAIT_S = 0.005

# A step failure fails that step's requests; this many in a row with no good step between them means
# the device or model is broken for good (a lost GPU fails every step), and the engine gives up.
MAX_FAILED_STEPS_IN_A_ROW = 3

_FINISH_STATUS = {"abort": RequestStatus.FINISHED_ABORTED, "stop": RequestStatus.FINISHED_STOPPED,
                  "error": RequestStatus.FINISHED_ERROR}


def seed_everything(seed: int) -> None:
    """Seeds what unseeded sampling draws from (torch's generators, CUDA's included) and Python's and
    numpy's, as vLLM's --seed does."""
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


class EngineDeadError(RuntimeError):
    """The engine cannot run steps any more; the server should report itself unhealthy.
    `process_lost`: a process of the engine (a worker rank) is gone or hung; the server exits, as when
    it loses the engine core process itself."""

    def __init__(self, message: str, process_lost: bool = False):
        super().__init__(message)
        self.process_lost = process_lost


@dataclass(frozen=True)
class ModelSpec:
    """What both sides of the engine resolve from its arguments without building the model."""
    source: ModelSource
    config: EngineConfig
    model_name: str
    # Every name clients may send (model_name is the first); where the tokenizer comes from; the
    # sampling defaults of the model's generation config (models/generation_config.py).
    served_model_names: tuple[str, ...] = ()
    tokenizer_source: ModelSource | None = None
    sampling_defaults: dict = field(default_factory=dict)
    lora_config: object | None = None  # lora.registry.LoRAConfig with --enable-lora
    world_size: int = 1  # ranks (tensor x pipeline parallel)


def _check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is visible to torch (torch {torch.__version__}"
                         f"{', built without CUDA' if torch.version.cuda is None else ''}); use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"--device must be cuda, cuda:N or cpu, got {device!r}")


def resolve_model_spec(args: EngineArgs) -> ModelSpec:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check_device(device)
    source = resolve_model(args.model)
    tokenizer_source = resolve_model(args.tokenizer) if args.tokenizer else None
    defaults = sampling_defaults(args.generation_config, source.directory, bool(source.gguf_file),
                                 args.override_generation_config)
    hf_config = load_hf_config(source)
    if args.num_frames is not None:  # frames sampled per video (Video NeVA); the model reads it
        if args.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {args.num_frames}")
        hf_config.num_frames = args.num_frames
    dtype = resolve_dtype(args.dtype, hf_config, device)
    quant_config = resolve_quant_config(args.quantization, hf_config, None if source.gguf_file else source.directory)
    context = getattr(hf_config, "max_position_embeddings", None) or 2048
    if args.max_model_len is not None and args.max_model_len > context:
        raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's context of {context} tokens")
    max_model_len = args.max_model_len or context
    eos = {hf_config.eos_token_id} if isinstance(hf_config.eos_token_id, int) else set(hf_config.eos_token_id or [])
    eos |= set(read_generation_eos(source))
    arch, _ = get_model_class(hf_config.architectures, hf_config)
    backend = args.attention_backend or ("triton" if device.startswith("cuda") else "torch_ref")
    config = EngineConfig(
        model=ModelConfig(hf_config, arch, dtype, max_model_len, hf_config.vocab_size, tuple(sorted(eos)),
                          quant_config),
        cache=CacheConfig(args.block_size, args.gpu_memory_utilization, args.num_blocks,
                          args.cpu_kv_cache_gib, args.enable_prefix_caching, args.kv_cache_dtype),
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.scheduling_policy),
        compile=CompileConfig(enforce_eager=args.enforce_eager),
        device=device, attention_backend=backend)
    names = tuple(args.served_model_name or (source.name,))
    from splitserve.lora.registry import lora_config_from_args
    return ModelSpec(source, config, names[0], names, tokenizer_source, defaults, lora_config_from_args(args),
                     args.world_size)


def _check_kv_cache_dtype(config: EngineConfig) -> None:
    """FP8 e4m3 in Triton kernels ("fp8e4nv") needs Ada/Hopper or newer: say so at start-up rather
    than fail in a kernel compile."""
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, config.model.dtype)
    if (kv_dtype == torch.float8_e4m3fn and config.device.startswith("cuda") and config.attention_backend == "triton"
            and torch.cuda.is_available() and torch.cuda.get_device_capability(config.device) < (8, 9)):
        raise ValueError("kv_cache_dtype fp8 with the triton attention backend needs a GPU of compute capability "
                         "8.9 or newer (Ada, Hopper); use kv_cache_dtype auto")


def _structured_manager(args: EngineArgs, spec: ModelSpec):
    """The grammar state of constrained requests: in a grammar process of its own (the default), or in
    this process (`structured_outputs_fill="inline"`, and the fallback when the process cannot start).
    The tokenizer, for xgrammar's view of the vocabulary, is the front's, loaded the same way (by the
    grammar process itself, or here on the first constrained request)."""
    loader = functools.partial(load_serving_tokenizer, spec.source, spec.tokenizer_source, args.random_weights)
    m = spec.config.model
    if args.structured_outputs_fill == "inline":
        return StructuredOutputManager(m.vocab_size, m.eos_token_ids, loader)
    manager = GrammarProcessManager(m.vocab_size, m.eos_token_ids, loader, max_rows=args.max_num_seqs)
    if spec.config.device.startswith("cuda"):  # on CPU the model's threads use every core: no head start there
        manager.start()  # not waited for: its ~5 s start-up overlaps serving, not the first constrained request
    return manager


class EngineCore:
    def __init__(self, args: EngineArgs, spec: ModelSpec | None = None):
        spec = spec or resolve_model_spec(args)
        config = spec.config
        _check_kv_cache_dtype(config)  # here, not in resolve_model_spec: the front must not touch CUDA
        self.config = config
        device, m = config.device, config.model
        self.lora = None  # the LoRAManager with --enable-lora (lora/)
        if args.world_size > 1:
            self._init_ranks(args, spec)
        else:
            self._init_runner(args, spec)
        install_step_faults(self.runner)  # test-only; a no-op unless SPLITSERVE_INJECT_STEP_FAULTS is set
        # Blocks every layer's window has passed go back to the pool (None: some layer sees everything).
        self.kv_manager = KVCacheManager(self.num_blocks, args.block_size, args.enable_prefix_caching,
                                         sliding_window=self._kv_free_window(m.hf_config))
        # Grammars compile and masks fill off the core's thread (a grammar process, started here in the
        # background with a GPU, else by the first constrained request; or threads here).
        self.structured = _structured_manager(args, spec)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.structured, self.lora)
        self.async_scheduling = device.startswith("cuda") if args.async_scheduling is None else args.async_scheduling
        # A runner in this process takes a step's grammar masks after its launch (ModelRunner.sample);
        # worker processes get them in the step message.
        self._masks_after_launch = args.world_size == 1
        self._inflight = None  # the launched step whose results are not processed yet
        self._failed_steps_in_a_row = 0
        self.num_received = 0
        self.last_step_tokens = 0  # tokens the last step() launched (0: it launched nothing)
        # Start-up leaves millions of long-lived objects (modules, compiled graphs, sympy expressions);
        # every full collection while serving would walk them all, stalling a step for ~0.1 s. Freeze
        # them out of the collector's view (what start-up left as garbage stays: a little memory).
        gc.freeze()
        if args.seed is not None:  # after warm-up: the same seed gives the same draws whatever it ran
            seed_everything(args.seed)
        placement = device if args.world_size == 1 else (
            f"{args.world_size} ranks (tp {args.tensor_parallel_size} x pp {args.pipeline_parallel_size}) on {device}")
        logger.info("engine core ready: %s on %s, %s, backend %s, KV cache %s, quantization %s", m.architecture,
                    placement, m.dtype, config.attention_backend,
                    str(self.runner.kv_cache_dtype).removeprefix("torch."), m.quantization or "none")

    def _init_ranks(self, args: EngineArgs, spec: ModelSpec) -> None:
        """World size > 1: one worker process per rank, stepped through the executor (distributed/)."""
        from splitserve.executor.multiproc import MultiprocExecutor
        if args.node_rank != 0:
            raise ValueError(f"node_rank {args.node_rank}: the engine runs on node 0; on the other nodes "
                             f"`splitserve serve --node-rank {args.node_rank} ...` starts their ranks only")
        if args.enable_lora:
            raise ValueError("--enable-lora with tensor or pipeline parallelism is not supported yet: "
                             "serve adapters with --tensor-parallel-size 1 --pipeline-parallel-size 1")
        config = spec.config
        self.runner = MultiprocExecutor(args, spec, resolve_kv_cache_dtype(config.cache.kv_cache_dtype,
                                                                           config.model.dtype))
        self.num_blocks = self.runner.num_blocks
        self.model = None  # in the ranks

    def _init_runner(self, args: EngineArgs, spec: ModelSpec) -> None:
        """World size 1: the model and its runner in this process."""
        config = spec.config
        device, m = config.device, config.model
        compiles = device.startswith("cuda") and not args.enforce_eager
        # The compiler stack's Python sources and the attention kernels compile in forked children
        # while the model is built; forked before any thread of ours starts.
        bytecode = start_bytecode_warmup() if compiles else None
        precompile = None
        if compiles:  # None for a backend that compiles no kernels on first launch
            precompile = start_attention_precompile(
                m.hf_config, m.dtype, args.block_size, args.max_num_batched_tokens, m.max_model_len,
                config.compile.decode_graph_sizes(args.max_num_seqs), config.attention_backend,
                kv_dtype=resolve_kv_cache_dtype(config.cache.kv_cache_dtype, m.dtype))
        try:
            t0 = time.perf_counter()
            _, model = load_model(spec.source, m.hf_config, m.dtype, device, args.random_weights, m.quant_config,
                              m.max_model_len)
            logger.info("model built in %.1f s", time.perf_counter() - t0)
            self.lora, lora_worker = None, None  # LoRAManager / LoRAWorker with --enable-lora
            if args.enable_lora:
                from splitserve.lora.manager import build_lora
                self.lora, lora_worker = build_lora(args, m.hf_config, m.dtype, model)
            self.runner = ModelRunner(config, model, lora_worker)
            self.num_blocks = self.runner.determine_num_blocks()
            self.runner.allocate_kv_cache(self.num_blocks)
            if bytecode is not None:
                bytecode.wait(timeout=10.0)  # compiling the model imports what they compile
            self.runner.setup_fast_path()
        finally:
            if precompile is not None:
                precompile.finish()
        self.model = model

    def _kv_free_window(self, hf_config) -> int | None:
        """The window after which the KV manager frees a request's blocks: read off the model's
        Attention layers in this process; with ranks (the model is in their processes) from the
        config, as the decoder reads its windows."""
        if self.model is not None:
            return kv_free_window(self.model)
        try:
            windows = decoder_spec(getattr(hf_config, "text_config", None) or hf_config).windows
        except (AttributeError, ValueError):
            return None
        return None if not windows or None in windows else max(windows)

    def check_ranks(self) -> None:
        """Raises EngineDeadError if a worker rank died or failed (the core loop asks while idle)."""
        check = getattr(self.runner, "check_alive", None)
        if check is not None:
            try:
                check()
            except RanksLostError as exc:
                raise EngineDeadError(str(exc), process_lost=True) from exc

    def shutdown(self) -> None:
        """Stops the worker processes (world size > 1); nothing to do in one process."""
        self.structured.shutdown()
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        self.num_received += 1
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_ids,
                          req.max_total_tokens, req.arrival_time, req.priority, mm_items=req.mm_items,
                          lora_request=req.lora_request, encoder_prompt_ids=req.encoder_prompt_ids,
                          num_encoder_tokens=req.num_encoder_tokens)
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.lora_request is not None:
            if self.lora is None:
                raise ValueError("a LoRA adapter was requested, but LoRA is not enabled (--enable-lora)")
            self.lora.is_loaded(req.lora_request)  # starts loading it, off the step loop
        if req.sampling_params.structured_outputs is not None:
            self.structured.register(request)  # its grammar compiles meanwhile; admitted when ready
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str], reason: str = "abort") -> None:
        """Ends sequences wherever they are and frees their blocks; unknown ids are ignored. The front
        already knows how they end, so nothing is reported back."""
        self.scheduler.finish_requests(request_ids, _FINISH_STATUS[reason])
        self._flush_removals()

    def reset_inflight(self) -> None:
        """Forgets the step in flight (after a failure that ended all of its requests)."""
        self._inflight = None
        if self.structured.fills_elsewhere:
            self.structured.discard_fill()
        self.scheduler.forget_steps()
        self._flush_removals()

    def _flush_removals(self) -> None:
        """With nothing left to schedule, no step message would tell the worker which requests left:
        send it one that runs nothing, so an idle engine's worker holds no request."""
        if not self.scheduler.has_unfinished():
            sched = self.scheduler.schedule()
            if sched.has_removals:
                self._update_states(sched)

    def _update_states(self, sched) -> None:
        try:
            self.runner.update_states(sched)
        except RanksLostError as exc:
            raise EngineDeadError(str(exc), process_lost=True) from exc

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def stats(self) -> SchedulerStats:
        kv = self.kv_manager
        return SchedulerStats(len(self.scheduler.running), len(self.scheduler.waiting), kv.usage(),
                              kv.prefix_queries, kv.prefix_hits, self.scheduler.num_preemptions, self.num_received)

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedules and launches one step, then processes the results of the step before it.

        With async scheduling the host work of step N+1 (scheduling, input layout, launch) overlaps
        the device's work on step N: requests whose tokens from N are still pending are scheduled
        with them as inputs, filled in on the device. A request that N ends (EOS, stop string) wastes
        its slot in N+1, whose token is then discarded. Without it, each step is collected first.

        Grammar masks (runner in this process): the forward of N+1 is launched without them. With a
        grammar process, N's tokens go to it as soon as they are in, with N+1's rows; the rows are
        taken at the start of the next call, just before N+1's sampler (and N+2's schedule and launch):
        the fill overlaps the rest of the core's host work. Filled here, they follow N's results."""
        outputs: list[EngineCoreOutput] = []
        inflight, self._inflight = self._inflight, None
        if inflight is not None and (not self.async_scheduling or inflight.needs_sync):
            inflight = self._finish_sampling(inflight, outputs)
            if inflight is not None:
                outputs += self._process(inflight)
            inflight = None
        if inflight is not None:
            # Its sampler goes first: this step's forward reads its tokens. Before the schedule: if
            # it fails, its requests end first, and no step is scheduled on tokens it will not give.
            inflight = self._finish_sampling(inflight, outputs)
        if self.structured.live:
            outputs += self._fail_grammars()
        if self.lora is not None:
            outputs += self._fail_lora_loads()
        sched = self.scheduler.schedule()
        self.last_step_tokens = sched.total_num_scheduled_tokens
        constrained = []
        if not sched.is_empty:
            constrained = self.structured.sampling_requests(sched, self.scheduler.samples_after)
            if constrained and self._masks_after_launch:
                # Rows now, masks once the forward is enqueued and the step in flight has been taken in
                # (its tokens advance the matchers): filling them overlaps the device's forward.
                sched.grammar = GrammarBitmask([r.request_id for r in constrained])
            elif constrained:
                # Worker processes get the masks with the step: their matchers have seen every token
                # (a step where they sampled is collected before this one is scheduled).
                sched.grammar = GrammarBitmask([r.request_id for r in constrained],
                                               self.structured.fill_bitmask(constrained))
            try:
                launched = self.runner.launch(sched, inflight)
            except RanksLostError as exc:
                raise EngineDeadError(str(exc), process_lost=True) from exc
            except Exception as exc:
                outputs += self._fail_step(sched, exc, launched=False)
            else:
                num_samples = self.scheduler.advance(sched)
                assert launched.sample_requests is None or num_samples == len(launched.sample_requests), \
                    "scheduler and worker disagree on who samples"
                self._inflight = launched
        elif sched.has_removals:  # nothing to run, but the worker must let go of these requests
            self._update_states(sched)
        if sched.is_empty and inflight is None and self._inflight is None and self.structured.live:
            self.structured.wait_for_compiles(_COMPILE_WAIT_S)  # all that is left waits for a grammar
        if sched.is_empty and inflight is None and self._inflight is None and self.lora is not None:
            self.lora.wait_for_loads(_COMPILE_WAIT_S)  # or for an adapter to load
        awaiting = self._inflight is not None and self._inflight.awaiting_mask is not None
        fill_elsewhere = awaiting and self.structured.fills_elsewhere
        if fill_elsewhere:
            self.structured.queue_fill(constrained)  # goes out with the tokens of `inflight`, or alone
        if inflight is not None:
            outputs += self._process(inflight)
        if fill_elsewhere:
            self.structured.send_fill()
        elif awaiting:
            outputs += self._sample_constrained(constrained)
        if self._inflight is not None and not self.async_scheduling:
            launched, self._inflight = self._finish_sampling(self._inflight, outputs), None
            if launched is not None:
                outputs += self._process(launched)
        self._flush_removals()
        return outputs

    def _finish_sampling(self, launched, outputs: list[EngineCoreOutput]):
        """Enqueues the sampler of a step launched without its grammar masks, with the rows the
        grammar process filled; returns the step (None if it failed: its requests have ended)."""
        if launched.awaiting_mask is None:
            return launched
        try:
            self.runner.sample(launched, self.structured.take_fill())
        except Exception as exc:
            outputs += self._fail_step(launched.sched, exc)
            return None
        return launched

    def _sample_constrained(self, constrained: list) -> list[EngineCoreOutput]:
        """Fills the launched step's grammar masks (the device is running its forward) and enqueues
        its sampler."""
        launched = self._inflight
        try:
            self.runner.sample(launched, self.structured.fill_bitmask(constrained))
        except Exception as exc:
            self._inflight = None
            return self._fail_step(launched.sched, exc)
        return []

    def _fail_grammars(self) -> list[EngineCoreOutput]:
        """Ends the requests whose grammar failed to compile (the front checks grammars, so this is
        rare: a tokenizer that cannot be loaded, say)."""
        outputs = []
        for request, reason in self.structured.take_failed():
            logger.error("request %s: %s", request.request_id, reason)
            if self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR):
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="error", stop_reason=reason))
        return outputs

    def _fail_lora_loads(self) -> list[EngineCoreOutput]:
        """Ends the waiting requests whose adapter failed to load (the front checks adapters, so this
        is rare: files removed or changed since)."""
        outputs = []
        for lora_id, reason in self.lora.take_failed():
            ids = [r.request_id for r in self.scheduler.waiting
                   if r.lora_request is not None and r.lora_request.lora_int_id == lora_id]
            for request in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR):
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="error", stop_reason=reason))
            self.lora.forget(lora_id)
        return outputs

    def _fail_step(self, sched, exc: Exception, launched: bool = True) -> list[EngineCoreOutput]:
        """A failed step fails its requests, not the engine (unless steps keep failing)."""
        logger.exception("model step failed; failing its %d requests", len(sched.num_scheduled_tokens))
        failed = self.scheduler.fail_step(sched, RequestStatus.FINISHED_ERROR, launched)
        self._failed_steps_in_a_row += 1
        if self._failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise EngineDeadError(f"{self._failed_steps_in_a_row} model steps failed in a row; "
                                  f"last error: {exc}") from exc
        return [EngineCoreOutput(r.request_id, [], finish_reason="error") for r in failed]

    def _process(self, inflight) -> list[EngineCoreOutput]:
        """Waits for a launched step's tokens and applies them: one output per sequence that got a
        token (or that ended)."""
        sched = inflight.sched
        try:
            result = self.runner.collect(inflight)
        except RanksLostError as exc:
            raise EngineDeadError(str(exc), process_lost=True) from exc
        except Exception as exc:
            return self._fail_step(sched, exc)
        self._failed_steps_in_a_row = 0
        outputs = []
        for request in self.scheduler.update(sched, result.tokens, result.prompt_logprobs):
            if request.status == RequestStatus.FINISHED_ERROR:  # its grammar process was lost
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="error",
                                                stop_reason=request.stop_reason))
                continue
            lp = result.logprobs.get(request.request_id)
            out = EngineCoreOutput(request.request_id, [request.output_token_ids[-1]],
                                   None if lp is None else [lp], request.status.finish_reason,
                                   request.stop_reason, request.num_cached_tokens)
            if lp is not None:
                out.new_logprob_ranks = [result.logprob_ranks.get(request.request_id, 0)]
            if len(request.output_token_ids) == 1:
                if request.first_scheduled_time is not None:
                    out.queue_time = request.first_scheduled_time - request.arrival_time
                if request.sampling_params.prompt_logprobs is not None:  # gathered chunk by chunk
                    out.prompt_logprobs, out.prompt_logprob_ranks = request.prompt_logprobs, request.prompt_logprob_ranks
                    request.prompt_logprobs, request.prompt_logprob_ranks = [], []
            outputs.append(out)
        return outputs
