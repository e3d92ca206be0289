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

import torch

from splitserve.config import EngineConfig, resolve_kv_cache_dtype
from splitserve.core.executor import Executor
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.request import Request, RequestStatus
from splitserve.core.scheduler import Scheduler
from splitserve.ttft_trace import CoreTracer, enabled as ttft_enabled
from splitserve.fault_injection import install_step_faults
from splitserve.loading.resolve import load_serving_tokenizer
from splitserve.protocol.core_messages import EngineCoreOutput, EngineCoreRequest, KVTransferCounters, SchedulerStats
from splitserve.protocol.rank_messages import RanksLostError
from splitserve.protocol.sched_output import GrammarBitmask
from splitserve.structured_output.manager import StructuredOutputManager
from splitserve.structured_output.process_manager import GrammarProcessManager

logger = logging.getLogger(__name__)

# How long a step that can schedule nothing waits for a grammar compile before it returns.
_COMPILE_WAIT_S = 0.005

# A step failure fails that step's requests; this many in a row with no good step between them means
# the device or model is broken for good (a lost GPU fails every step), and the engine gives up.
MAX_FAILED_STEPS_IN_A_ROW = 3

_FINISH_STATUS = {"abort": RequestStatus.FINISHED_ABORTED, "stop": RequestStatus.FINISHED_STOPPED,
                  "error": RequestStatus.FINISHED_ERROR}


class EngineDeadError(RuntimeError):
    """The engine cannot run steps any more; the server should report itself unhealthy.
    `process_lost`: a process of the engine (a worker rank) is gone or hung; the server exits, as when
    it loses the engine core process itself."""

    def __init__(self, message: str, process_lost: bool = False):
        super().__init__(message)
        self.process_lost = process_lost


def _check_kv_cache_dtype(config: EngineConfig) -> None:
    """FP8 e4m3 in Triton kernels ("fp8e4nv") needs Ada/Hopper or newer: say so at start-up rather
    than fail in a kernel compile."""
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, config.model.dtype)
    if (kv_dtype == torch.float8_e4m3fn and config.device.startswith("cuda") and config.attention_backend == "triton"
            and torch.cuda.is_available() and torch.cuda.get_device_capability(config.device) < (8, 9)):
        raise ValueError("kv_cache_dtype fp8 with the triton attention backend needs a GPU of compute capability "
                         "8.9 or newer (Ada, Hopper); use kv_cache_dtype auto")


def _structured_manager(config: EngineConfig):
    """The grammar state of constrained requests: in a grammar process of its own (the default), or in
    this process (`structured_outputs_fill="inline"`, and the fallback when the process cannot start).
    The tokenizer, for xgrammar's view of the vocabulary, is the front's, loaded the same way (by the
    grammar process itself, or here on the first constrained request)."""
    load = config.load
    loader = functools.partial(load_serving_tokenizer, load.source, load.tokenizer_source, load.random_weights)
    m = config.model
    # Speculative decoding checks drafts against the matchers while scheduling: they live here then.
    if config.structured_outputs_fill == "inline" or config.speculative is not None:
        return StructuredOutputManager(m.vocab_size, m.eos_token_ids, loader)
    manager = GrammarProcessManager(m.vocab_size, m.eos_token_ids, loader, max_rows=config.scheduler.max_num_seqs)
    if config.device.startswith("cuda"):  # on CPU the model's threads use every core: no head start there
        manager.start()  # not waited for: its ~5 s start-up overlaps serving, not the first constrained request
    return manager


def _kv_pool(config: EngineConfig, executor):
    """What the KV connector reads and writes: the pool's tensors in this process, or (rank processes,
    which serve their blocks themselves) its layout only."""
    from splitserve.kv_transfer.pool import KVLayout, KVPool, LayoutOnly
    tp = config.parallel.tensor_parallel_size
    if executor.kv_caches is not None:
        return KVPool(executor.kv_caches)
    from splitserve.kv_transfer.pool import rank_heads
    m = config.model
    dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, m.dtype)
    return LayoutOnly(KVLayout(m.num_layers, len(rank_heads(m.num_kv_heads, tp, 0)), m.head_dim,
                               config.cache.block_size, str(dtype).removeprefix("torch."), tp, m.num_kv_heads))


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor):
        """`executor` runs the model (executor/: in this process, or one worker process per rank) and
        was built from the same config; the core owns it from here on (shutdown stops it)."""
        _check_kv_cache_dtype(config)  # here, not in the config builder: the front must not touch CUDA
        self.config = config
        device, m = config.device, config.model
        self.executor = executor
        self.lora = executor.lora  # the LoRAManager with --enable-lora (lora/)
        install_step_faults(executor)  # test-only; a no-op unless SPLITSERVE_INJECT_STEP_FAULTS is set
        # The KV connector (kv_transfer/): another engine's blocks in, ours out, or a host-memory tier.
        self.kv_connector = None
        if config.kv_transfer is not None:
            from splitserve.kv_transfer.registry import build_connector
            self.kv_connector = build_connector(config.kv_transfer, _kv_pool(config, executor))
        self.kv_manager = KVCacheManager(executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                         sliding_window=executor.kv_free_window,
                                         host_tier=getattr(self.kv_connector, "host_tier", None))
        # Grammars compile and masks fill off the core's thread (a grammar process, started here in the
        # background with a GPU, else by the first constrained request; or threads here).
        self.structured = _structured_manager(config)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.structured, self.lora, self.kv_connector,
                                   config.kv_transfer.kv_load_failure_policy if config.kv_transfer else "recompute",
                                   spec=config.speculative)
        self.async_scheduling = config.runs_async
        # A runner in this process takes a step's grammar masks after its launch (ModelRunner.sample);
        # worker processes get them in the step message.
        self._masks_after_launch = config.world_size == 1
        self._inflight = None  # the launched step whose results are not processed yet
        self._failed_steps_in_a_row = 0
        self.num_received = 0
        self.last_step_tokens = 0  # tokens the last step() launched (0: it launched nothing)
        # The per-request TTFT breakdown (SPLITSERVE_TTFT_LOG; ttft_trace.py), or None (off).
        self.ttft = CoreTracer() if ttft_enabled() else None
        # Start-up leaves millions of long-lived objects (modules, compiled graphs, sympy expressions);
        # every full collection while serving would walk them all, stalling a step for ~0.1 s. Freeze
        # them out of the collector's view (what start-up left as garbage stays: a little memory).
        gc.freeze()
        par = config.parallel
        placement = device if par.world_size == 1 else (
            f"{par.world_size} ranks (tp {par.tensor_parallel_size} x pp {par.pipeline_parallel_size}) on {device}")
        kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, m.dtype)
        logger.info("engine core ready: %s on %s, %s, backend %s, KV cache %s, quantization %s", m.architecture,
                    placement, m.dtype, config.attention_backend, str(kv_dtype).removeprefix("torch."),
                    m.quantization or "none")

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks

    def check_ranks(self) -> None:
        """Raises EngineDeadError if a worker rank died or failed (the core loop asks while idle)."""
        try:
            self.executor.check_alive()
        except RanksLostError as exc:
            raise EngineDeadError(str(exc), process_lost=True) from exc

    def shutdown(self) -> None:
        """Stops the grammar process, the KV connector and the executor (its worker processes, with
        world size > 1)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        self.structured.shutdown()
        self.executor.shutdown()

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        self.num_received += 1
        extra = req.sampling_params.extra_args or {}
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_ids,
                          req.max_total_tokens, req.arrival_time, req.priority, mm_items=req.mm_items,
                          lora_request=req.lora_request, encoder_prompt_ids=req.encoder_prompt_ids,
                          num_encoder_tokens=req.num_encoder_tokens, bad_words_token_ids=req.bad_words_token_ids,
                          kv_transfer_params=extra.get("kv_transfer_params"))
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.lora_request is not None:
            if self.lora is None:
                raise ValueError("a LoRA adapter was requested, but LoRA is not enabled (--enable-lora)")
            self.lora.is_loaded(req.lora_request)  # starts loading it, off the step loop
        if req.sampling_params.structured_outputs is not None:
            self.structured.register(request)  # its grammar compiles meanwhile; admitted when ready
        self.scheduler.add_request(request)
        if self.ttft is not None:
            self.ttft.on_add(request)

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
            if sched.has_updates:
                self._update_states(sched)

    def _update_states(self, sched) -> None:
        try:
            self.executor.update_states(sched)
        except RanksLostError as exc:
            raise EngineDeadError(str(exc), process_lost=True) from exc

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def idle_work(self) -> None:
        """What an idle core still does: free the blocks held for remote readers that acknowledged,
        or whose lease ended (the core loop calls this while it waits for requests)."""
        if self.kv_connector is not None and self.kv_connector.busy:
            self.scheduler.poll_connector()

    def stats(self) -> SchedulerStats:
        kv, sch = self.kv_manager, self.scheduler
        stats = SchedulerStats(len(sch.running), len(sch.waiting), kv.usage(),
                               kv.prefix_queries, kv.prefix_hits, sch.num_preemptions, self.num_received,
                               num_receiving=len(sch.receiving), num_held=kv.num_held,
                               prompt_tokens_computed=sch.num_prompt_tokens_computed,
                               spec_num_drafts=sch.spec_num_drafts, spec_num_draft_tokens=sch.spec_num_draft_tokens,
                               spec_num_accepted_tokens=sch.spec_num_accepted_tokens,
                               spec_accepted_per_pos=list(sch.spec_accepted_per_pos))
        if self.kv_connector is not None:
            t = self.kv_connector.stats
            stats.kv_transfer = KVTransferCounters(t.sent_tokens, t.sent_bytes, t.recv_tokens, t.recv_bytes, t.failed,
                                                   list(t.time_buckets), t.time_sum, t.offload_saved_blocks,
                                                   t.offload_hit_tokens)
        return stats

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
        ttft = self.ttft
        if ttft is not None:
            t_sched = time.monotonic()
        sched = self.scheduler.schedule()
        if ttft is not None:
            ttft.on_schedule(sched, t_sched, self.scheduler.requests)
        if self.scheduler.kv_failed:  # loads that failed under kv_load_failure_policy "fail"
            failed, self.scheduler.kv_failed = self.scheduler.kv_failed, []
            outputs += [EngineCoreOutput(r.request_id, [], finish_reason="error", stop_reason=r.stop_reason)
                        for r in failed]
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
                                               self.structured.fill_bitmask(constrained, sched.spec_token_ids))
            try:
                launched = self.executor.launch(sched, inflight)
            except RanksLostError as exc:
                raise EngineDeadError(str(exc), process_lost=True) from exc
            except Exception as exc:
                outputs += self._fail_step(sched, exc, launched=False)
            else:
                if ttft is not None:
                    ttft.on_launched(sched)
                num_samples = self.scheduler.advance(sched)
                assert launched.sample_requests is None or num_samples == len(launched.sample_requests), \
                    "scheduler and worker disagree on who samples"
                self._inflight = launched
        elif sched.has_updates:  # nothing to run, but the worker must let go of these requests
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
            self.executor.sample(launched, self.structured.take_fill())
        except Exception as exc:
            outputs += self._fail_step(launched.sched, exc)
            return None
        return launched

    def _sample_constrained(self, constrained: list) -> list[EngineCoreOutput]:
        """Fills the launched step's grammar masks (the device is running its forward) and enqueues
        its sampler."""
        launched = self._inflight
        try:
            self.executor.sample(launched, self.structured.fill_bitmask(constrained, launched.sched.spec_token_ids))
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
            result = self.executor.collect(inflight)
        except RanksLostError as exc:
            raise EngineDeadError(str(exc), process_lost=True) from exc
        except Exception as exc:
            return self._fail_step(sched, exc)
        self._failed_steps_in_a_row = 0
        if self.ttft is not None:
            self.ttft.on_collected(sched)
        outputs = []
        for request in self.scheduler.update(sched, result.tokens, result.prompt_logprobs, result.more_tokens,
                                             result.draft_token_ids):
            if request.status == RequestStatus.FINISHED_ERROR:  # its grammar process was lost
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="error",
                                                stop_reason=request.stop_reason))
                continue
            rid, num_new = request.request_id, request.num_new_tokens
            lp = result.logprobs.get(rid)
            out = EngineCoreOutput(rid, request.output_token_ids[-num_new:],
                                   None if lp is None else [lp], request.status.finish_reason,
                                   request.stop_reason, request.num_cached_tokens)
            if lp is not None:
                out.new_logprob_ranks = [result.logprob_ranks.get(rid, 0)]
                if num_new > 1:  # accepted drafts (speculative decoding): a logprob for each new token
                    out.new_logprobs += result.more_logprobs[rid][:num_new - 1]
                    out.new_logprob_ranks += result.more_logprob_ranks[rid][:num_new - 1]
            if request.ttft_trace is not None:
                out.ttft_trace = CoreTracer.first_token(request)
            if request.kv_params_out is not None:  # a producer holds its blocks for a decode engine
                out.kv_transfer_params = request.kv_params_out
            if len(request.output_token_ids) == 1:
                if request.first_scheduled_time is not None:
                    out.queue_time = request.first_scheduled_time - request.arrival_time
                if request.sampling_params.prompt_logprobs is not None:  # gathered chunk by chunk
                    out.prompt_logprobs, out.prompt_logprob_ranks = request.prompt_logprobs, request.prompt_logprob_ranks
                    request.prompt_logprobs, request.prompt_logprob_ranks = [], []
            outputs.append(out)
        return outputs
