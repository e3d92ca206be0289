"""Turns a scheduler decision into one forward pass: flat inputs, attention metadata, model, sampler.

The runner decides no policy. It receives the scheduler's step message (plain data,
protocol/sched_output.py), applies its deltas to its persistent batch (worker/input_batch.py) and lays
out, for each scheduled request, its tokens from num_computed_tokens on and its block table as one
ragged batch: numpy gathers over the batch's rows.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from splitserve.attention.backend import AttentionMetadata
from splitserve.attention.layer import Attention, ForwardContext, forward_context
from splitserve.attention.registry import get_backend
from splitserve.config import EngineConfig, resolve_kv_cache_dtype
from splitserve.protocol.sched_output import SchedulerOutput
from splitserve.layers.linear import cheaper_at_one_row
from splitserve.layers.rejection_sampler import RejectionSampler, VerifyLayout, forced_acceptance
from splitserve.layers.sampler import Sampler, SamplingMetadata
from splitserve.models.interfaces import capabilities_of
from splitserve.worker.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from splitserve.worker.input_batch import CachedRequestState, InputBatch
from splitserve.worker.prompt_logprobs import (PromptLogprobsPlan, compute_prompt_logprobs, plan_prompt_logprobs,
                                               prompt_logprobs_by_request)
from splitserve.worker.sampling_metadata import build_sampling_metadata
from splitserve.worker.spec_decode import (NgramProposer, collect_verified, expand_metadata, propose_drafts,
                                          write_drafts)
from splitserve.worker.warm_up import (  # noqa: F401 (also imported from here)
    compile_decoder_layers, supports_piecewise, warm_up_batch, warm_up_layouts)

logger = logging.getLogger(__name__)



# What the CUDA context and the libraries' handles take outside torch's allocator (an allowance).
_CUDA_CONTEXT_BYTES = 1 << 29

class _Staging:
    """Host buffers the step's inputs are written into (numpy views) and copied to the device from.
    Pinned on CUDA so the copies are asynchronous. The runner alternates two sets: a set is written
    again only after the step that used it has been collected (its copies long done), while the step
    launched in between may still have copies in flight from the other set. Every copied slice is
    contiguous (block tables use a flat buffer viewed at the step's width): a strided pinned slice
    would be copied through pageable memory, which synchronises the stream."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, pin: bool):
        def buf(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.tensors = {
            "input_ids": buf(max_tokens, torch.long), "positions": buf(max_tokens, torch.long),
            # logits rows: one per sampling sequence, and one per draft token of verifying ones
            "slot_mapping": buf(max_tokens, torch.long), "logits_indices": buf(max(max_seqs, max_tokens), torch.long),
            "query_start_loc": buf(max_seqs + 1, torch.int32), "seq_lens": buf(max_seqs, torch.int32),
            "block_tables": buf(max_seqs * max_blocks, torch.int32),
            "fill_dst": buf(max_seqs, torch.long), "fill_src": buf(max_seqs, torch.long)}
        for name, tensor in self.tensors.items():
            setattr(self, name, tensor.numpy())


@dataclass
class InFlightStep:
    """A launched step: its sampled tokens on the device (the next step's pending input ids) and
    their host copies, complete once `done` has fired."""
    sched: SchedulerOutput
    sample_requests: list[CachedRequestState]  # the worker's states of its sampling rows, in row order
    step_no: int = -1  # the runner's launch count when it was launched (pending_step of its rows)
    token_ids: torch.Tensor | None = None
    host: tuple = ()  # (token ids, logprobs, logprob ids, ranks) on the host, copied without blocking
    done: torch.cuda.Event | None = None
    needs_sync: bool = False  # the next step must see these tokens on the host (penalties, grammars)
    # (logits, sampling metadata) of a step whose grammar masks come after the forward (`sample`)
    awaiting_mask: tuple | None = None
    # prompt_logprobs: the plan and (values, ids, ranks) on the host, copied without blocking
    prompt_logprobs: tuple[PromptLogprobsPlan, tuple] | None = None
    # Speculative decoding: the verify layout of its sampling rows (None: no row verifies drafts),
    # and the drafts each sampling row checked (host lists, in row order).
    verify: VerifyLayout | None = None
    drafts: list[list[int]] | None = None
    propose: bool = False  # drafts are proposed from its tokens at collect
    eagle: object = None  # worker.eagle_head.EagleStep: the target's features for the head, filled at collect


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # [S] rows of the hidden states whose next token is sampled
    sample_requests: list[CachedRequestState]  # the S requests that sample this step, in row order
    inputs_embeds: torch.Tensor | None = None  # [T, hidden] when the step has image tokens
    sampling_metadata: SamplingMetadata | None = None  # of the S sampling rows (None when S == 0)
    # (request state, start, n, first flat row) of the sequences that compute image placeholder tokens
    mm_spans: list | None = None
    # Rows whose logits give prompt logprobs (None unless a request in the step asks for them), and
    # the results on the device once the model has run.
    prompt_logprobs: PromptLogprobsPlan | None = None
    prompt_logprobs_out: tuple | None = None
    # Speculative decoding: the drafts each sampling row verifies (None: none in this step).
    verify: VerifyLayout | None = None
    drafts: list[list[int]] | None = None


@dataclass
class StepResult:
    tokens: dict[str, int]
    logprobs: dict[str, dict[int, float]]
    # the sampled token's rank among all tokens by logprob, for each request that asked for logprobs
    logprob_ranks: dict[str, int] = field(default_factory=dict)
    # prompt_logprobs computed this step: {id: (first prompt-token index, entries, ranks)}, plain data
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]], list[int]]] = field(default_factory=dict)
    # Speculative decoding: the tokens after the first of requests that accepted drafts (and their
    # logprobs and ranks, when asked), and drafts proposed for each request's next step.
    more_tokens: dict[str, list[int]] = field(default_factory=dict)
    more_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    more_logprob_ranks: dict[str, list[int]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, lora=None, draft_model=None):
        self.config = config
        self.lora = lora  # lora.worker.LoRAWorker when LoRA is enabled
        self.model = model
        self.device = torch.device(config.device)
        self.backend = get_backend(config.attention_backend)
        self.sampler = Sampler()
        # Speculative decoding (worker/spec_decode.py): the drafts' proposer and their verifier.
        self.spec = config.speculative
        # forced_acceptance(): a benchmark-only hook, None unless SPLITSERVE_SPEC_FORCE_ACCEPT is set
        self.verifier = RejectionSampler(self.sampler, forced_acceptance()) if self.spec is not None else None
        self.proposer = None
        if self.spec is not None and self.spec.method == "ngram":
            self.proposer = NgramProposer(self.spec.num_speculative_tokens, self.spec.prompt_lookup_min,
                                          self.spec.prompt_lookup_max)
        self.drafter = None  # worker.draft_model.DraftModelProposer: a second model with its own KV tensors
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = config.cache.block_size
        # The cache's element type: the model's, or FP8 e4m3 (1 byte: twice the tokens of bf16 in the
        # same memory; the attention layers' k_scale / v_scale map it back).
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, config.model.dtype)
        self.max_blocks_per_seq = -(-config.model.max_model_len // self.block_size)
        self.stagings = [_Staging(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
                                  self.max_blocks_per_seq, pin=self.device.type == "cuda") for _ in range(2)]
        # The worker's persistent batch: what it keeps about each request between step messages.
        self.input_batch = InputBatch(config.scheduler.max_num_seqs, config.model.max_model_len,
                                      self.max_blocks_per_seq, config.model.vocab_size)
        self.num_launched = 0
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        # How many forwards took each path (benchmarks report the share of steps that replay graphs).
        self.steps_by_path = {"decode_graph": 0, "piecewise": 0, "eager": 0}
        # Vision-language models: encodes a step's images and builds its input embeddings.
        self.mm = None
        caps = capabilities_of(model)
        if caps.decoder_images:
            from splitserve.multimodal.step import MultiModalStepEncoder
            self.mm = MultiModalStepEncoder(model)
        # Encoder-decoder models: runs the encoders a step asks for and lays out its cross-attention.
        self.encdec = None
        if caps.encoder_decoder:
            from splitserve.worker.encoder_decoder import EncoderDecoderStep
            self.encdec = EncoderDecoderStep(model, self.backend, config.scheduler.max_num_seqs,
                                             config.scheduler.max_num_batched_tokens, self.block_size, self.device)
        if draft_model is not None:
            if self.mm is not None or self.encdec is not None:
                raise ValueError("speculative_config: a draft model serves text decoder models only")
            from splitserve.worker.draft_model import DraftModelProposer
            from splitserve.worker.eagle_head import EagleProposer
            self.drafter = EagleProposer(draft_model, self.spec.num_speculative_tokens, self.block_size,
                                         self.max_blocks_per_seq, self.backend, self.kv_cache_dtype, self.device,
                                         config.model.vocab_size) if self.spec.method.startswith("eagle") else \
                DraftModelProposer(draft_model, self.spec.draft_hf_config, self.spec.num_speculative_tokens,
                                              self.block_size, self.max_blocks_per_seq, self.backend,
                                              self.kv_cache_dtype, self.device)

    # -- KV cache --------------------------------------------------------------------------------
    def kv_layout(self) -> tuple[int, int]:
        """(layers, KV heads) of this rank's KV cache: the model's attention layers (a pipeline
        stage's own) and their KV heads (a tensor-parallel rank's own). The config's counts for a
        model without attention layers (tests that size a pool for a bare module)."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if not layers:
            return self.config.model.num_layers, self.config.model.num_kv_heads
        return len(layers), layers[0].num_kv_heads

    def bytes_per_block(self) -> int:
        m = self.config.model
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        num_layers, num_kv_heads = self.kv_layout()
        # (a draft model's cache has the same blocks: budgeted together)
        draft = self.drafter.bytes_per_block() if self.drafter is not None else 0
        return 2 * self.block_size * num_kv_heads * m.head_dim * elem * num_layers + draft

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # Keep room for activations of the largest step (logits in fp32 dominate for big vocabs).
            sched = self.config.scheduler
            m = self.config.model
            act = sched.max_num_batched_tokens * m.hf_config.hidden_size * 2 * 16 + \
                max(sched.max_num_seqs, 512) * m.vocab_size * 4 * 4 + (1 << 30)
            # This engine's share of the GPU less what it already holds (weights; the CUDA context
            # as an allowance), and never more than is free: data-parallel replicas that share a GPU
            # (--gpu-memory-utilization 0.45 each) each get their own share, whichever starts first.
            own = torch.cuda.memory_reserved(self.device) + _CUDA_CONTEXT_BYTES
            budget = min(total * cache.gpu_memory_utilization - own, free) - act
        else:
            budget = cache.cpu_kv_cache_gib * (1 << 30)
        num_blocks = int(budget // self.bytes_per_block())
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache; lower the model size or raise gpu_memory_utilization")
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.config.model
        num_layers, num_kv_heads = self.kv_layout()
        shape = (num_blocks, 2, self.block_size, num_kv_heads, m.head_dim)
        kt = self.config.kv_transfer
        if self.device.type == "cuda" and kt is not None and kt.kv_connector == "NixlConnector":
            # A NIXL engine's pool is block-major, a block of every layer contiguous: NIXL reads a block as
            # one descriptor, not one per layer (kv_transfer/nixl_transport.py). The layers are strided
            # views the Triton kernels take by stride (tests/attention/test_block_major_kv.py); the CPU
            # attention wants contiguous layers, and other engines keep one tensor per layer.
            whole = torch.zeros((num_blocks, num_layers) + shape[1:], dtype=self.kv_cache_dtype, device=self.device)
            self.kv_caches = list(whole.unbind(1))
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                              for _ in range(num_layers)]
        for module in self.model.modules():
            # A cross-attention layer shares its decoder layer's tensor (its blocks are another group's).
            if isinstance(module, Attention) or getattr(module, "shares_layer_kv_cache", False):
                module.kv_cache = self.kv_caches[module.layer_idx]
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", num_blocks, self.block_size,
                    num_blocks * self.bytes_per_block() / (1 << 30), str(self.kv_cache_dtype).removeprefix("torch."))

    # -- fast path (CUDA) --------------------------------------------------------------------------
    def setup_fast_path(self) -> None:
        """Compiles the decoder layers and captures decode CUDA graphs (CUDA without enforce_eager).
        An encoder-decoder model's decode graphs capture its forward as it is (its layers are not
        compiled), with the cross-attention ops inside; its other steps run eagerly."""
        if self.device.type != "cuda" or self.config.compile.enforce_eager:
            return
        start = time.perf_counter()
        if self.encdec is None:
            compile_decoder_layers(self.model)
        if self.drafter is not None:
            compile_decoder_layers(self.drafter.model)
        sizes = self.decode_graph_sizes()
        m = self.config.model
        lora_state = None if self.lora is None else self.lora.model.state  # graphs with the LoRA delta too
        cross_blocks = 0 if self.encdec is None else self.encdec.cross_table.shape[1]
        self.graphs = DecodeGraphs(self.model, self.backend, sizes, self.max_blocks_per_seq, m.max_model_len,
                                   self.kv_layout()[1], self.device, lora_state=lora_state,
                                   cross_blocks=cross_blocks, block_size=self.block_size,
                                   features=getattr(self.drafter, "graph_features", None))
        if self.encdec is None:
            self._warm_up_eager()
        logger.info("compiled and warmed up in %.1f s", time.perf_counter() - start)
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        self.graphs.capture(pool, stream)
        if self.drafter is not None:  # its proposal forwards: one token per sequence, like a decode step
            # (a pool of their own: they replay between the target's graphs of a step)
            self.drafter.setup_graphs([b for b in sizes if b > 1] or [2], m.max_model_len,
                                      torch.cuda.graph_pool_handle(), stream)
        budget = self.config.scheduler.max_num_batched_tokens
        piecewise_sizes = [n for n in self.config.compile.piecewise_token_sizes if n <= budget]
        if piecewise_sizes and self.encdec is None and supports_piecewise(self.model):
            self.piecewise = PiecewiseGraphs(self.model, piecewise_sizes, self.device, lora_state=lora_state,
                                             aux_layers=getattr(self.drafter, "aux_layers", ()))
            self.piecewise.capture(pool, stream)
        logger.info("fast path ready in %.1f s", time.perf_counter() - start)

    def decode_graph_sizes(self) -> list[int]:
        """Batch sizes of the decode graphs; with 1 when a linear layer of the model costs less at one
        token than at two (W4A16's GEMV), which also compiles the layer halves once more, for one
        token (the 0/1 specialisation of dynamic shapes), in the graph's warm-up run."""
        return self.config.compile.decode_graph_sizes(self.config.scheduler.max_num_seqs,
                                                      one_row=self.one_row_graph())

    def one_row_graph(self) -> bool:
        """Whether the decode graphs include one sequence (a rank's runner: whether any rank asks)."""
        return cheaper_at_one_row(self.model)

    @torch.inference_mode()  # inputs made here must be inference tensors, as when serving
    def _warm_up_eager(self) -> None:
        """Runs the compiled model at a few multi-token layouts so that compilation (Inductor, and the
        attention kernel's variants) happens at start-up, not on the first requests. Writes go to slot
        -1 only, so the cache is untouched; context is read from block 0 and discarded."""
        for num_seqs, q_len, context in warm_up_layouts(self.config.scheduler.max_num_batched_tokens, self.block_size):
            t = time.perf_counter()
            meta, positions = warm_up_batch(num_seqs, q_len, context, self.block_size, self.device)
            with forward_context(ForwardContext(meta, self.backend)):
                self.model(torch.zeros(positions.shape[0], dtype=torch.long, device=self.device), positions)
            if self.drafter is not None:  # its compiled layers too (a draft forward runs in every step)
                self.drafter.run_step(torch.zeros(positions.shape[0], dtype=torch.long, device=self.device),
                                      positions, meta)
            logger.debug("warm-up step of %d x %d tokens after %d took %.2f s", num_seqs, q_len, context,
                         time.perf_counter() - t)

    # -- one step --------------------------------------------------------------------------------
    def update_states(self, sched: SchedulerOutput) -> None:
        """Applies a step message's deltas to the persistent batch without running a step (a message
        that schedules nothing but carries removals, and perhaps slot loads sent again after a failed
        launch)."""
        if self.lora is not None:
            self.lora.apply_loads(sched.lora_loads)
        if self.drafter is not None:
            self.drafter.forget(sched.finished_req_ids + sched.preempted_req_ids)
        self.input_batch.update(sched)
        if self.encdec is not None:
            self.encdec.update(sched)
        if self.mm is not None:
            self.mm.prefetch(sched)

    def prepare(self, sched: SchedulerOutput, inflight: InFlightStep | None = None) -> ForwardBatch:
        """Applies the message to the persistent batch, lays the step out in staging buffers and copies
        it to the device. Tokens still pending from the in-flight step are taken from its sampled
        tokens on the device."""
        ib = self.input_batch
        if self.lora is not None:  # slots first: new rows look their adapter's slot up
            self.lora.apply_loads(sched.lora_loads)
        if self.drafter is not None:
            self.drafter.forget(sched.finished_req_ids + sched.preempted_req_ids)
        ib.update(sched)
        bs = self.block_size
        st = self.stagings[self.num_launched % 2]
        nst = sched.num_scheduled_tokens
        num_seqs = len(nst)
        rows = ib.rows_of(nst)
        counts = np.fromiter(nst.values(), dtype=np.int64, count=num_seqs)
        starts = ib.num_computed[rows]
        seq_lens = starts + counts
        qsl = st.query_start_loc[:num_seqs + 1]
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1:])
        total = int(qsl[-1])
        max_seq_len = int(seq_lens.max())
        width = -(-max_seq_len // bs)
        last = qsl[1:].astype(np.int64) - 1  # flat row of each sequence's last token
        # Speculative decoding: a verifying sequence's drafts follow its known tokens in its row
        # (tentatively: collect keeps the accepted ones); ends = where its verified tokens end.
        num_drafts = write_drafts(ib, sched.spec_token_ids, nst, rows)
        ends = seq_lens - num_drafts

        # position of every token = its sequence's start + offset within the step's chunk
        seq_index = np.repeat(np.arange(num_seqs), counts)
        positions = st.positions[:total]
        positions[:] = starts[seq_index] + (np.arange(total) - qsl[:-1][seq_index])
        token_rows = rows[seq_index]
        st.input_ids[:total] = ib.token_ids[token_rows, positions]
        block_tables = st.block_tables[:num_seqs * width].reshape(num_seqs, width)
        block_tables[:] = ib.block_table[rows, :width]
        slot_mapping = st.slot_mapping[:total]
        slot_mapping[:] = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        st.seq_lens[:num_seqs] = seq_lens

        # A sequence whose last input is past its known tokens runs on the token the in-flight step
        # sampled for it (async scheduling); only the last input can be pending.
        pending = np.flatnonzero(ends > ib.num_known[rows])
        # Sequences whose tokens are all computed after this step sample their next token.
        samples = np.flatnonzero(ends == ib.num_tokens[rows])
        sample_rows = rows[samples]
        num_samples = len(samples)
        sample_requests = [ib.row_states[r] for r in sample_rows.tolist()]
        meta_sampling = None
        if num_samples:
            meta_sampling = build_sampling_metadata(ib, sample_rows, sample_requests,
                                                    ends[samples] - ib.num_prompt[sample_rows], self.device,
                                                    sched.grammar)
        verify = drafts = None
        if sched.spec_token_ids and num_samples:
            # d + 1 logits rows per sampling sequence: its last token's and each draft's.
            spec = sched.spec_token_ids
            drafts = [spec.get(state.req_id, []) for state in sample_requests]
            verify = VerifyLayout.build(drafts)
            d = num_drafts[samples]
            first = np.repeat(last[samples] - d, d + 1)
            st.logits_indices[:verify.num_rows] = first + np.arange(verify.num_rows) - verify.row_start.repeat(d + 1)
            meta_sampling = expand_metadata(meta_sampling, d + 1)
            num_logits = verify.num_rows
        else:
            st.logits_indices[:num_samples] = last[samples]
            num_logits = num_samples
        fill_src = None
        if len(pending):
            assert inflight is not None and inflight.token_ids is not None, "pending tokens without a step in flight"
            pending_rows = rows[pending]
            assert (ib.pending_step[pending_rows] == inflight.step_no).all(), "pending token of another step"
            assert (ends[pending] == ib.num_known[pending_rows] + 1).all(), "more than one pending input"
            st.fill_dst[:len(pending)] = last[pending]
            st.fill_src[:len(pending)] = fill_src = ib.pending_src[pending_rows]
        # Before record_launch: rows that sample now have sampled nothing yet.
        plan = plan_prompt_logprobs(ib, rows, starts, counts, qsl) if ib.num_prompt_logprob_rows else None
        ib.record_launch(rows, seq_lens, sample_rows, self.num_launched)
        if self.lora is not None:
            self.lora.prepare_step(ib.lora_id[rows], counts)

        t = st.tensors
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=t["slot_mapping"][:total].to(dev, non_blocking=True),
            query_start_loc=t["query_start_loc"][:num_seqs + 1].to(dev, non_blocking=True),
            seq_lens=t["seq_lens"][:num_seqs].to(dev, non_blocking=True),
            block_tables=t["block_tables"][:num_seqs * width].view(num_seqs, width).to(dev, non_blocking=True),
            max_query_len=int(counts.max()), max_seq_len=max_seq_len,
            query_start_loc_cpu=t["query_start_loc"][:num_seqs + 1].clone(),
            seq_lens_cpu=t["seq_lens"][:num_seqs].clone())
        input_ids = t["input_ids"][:total].to(dev, non_blocking=True)
        if fill_src is not None:
            dst = t["fill_dst"][:len(pending)].to(dev, non_blocking=True)
            src = t["fill_src"][:len(pending)].to(dev, non_blocking=True)
            input_ids.index_copy_(0, dst, inflight.token_ids[src])
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=t["positions"][:total].to(dev, non_blocking=True),
            meta=meta,
            logits_indices=t["logits_indices"][:num_logits].to(dev, non_blocking=True),
            sample_requests=sample_requests, sampling_metadata=meta_sampling, prompt_logprobs=plan,
            verify=verify, drafts=drafts)
        if self.mm is not None:
            # Sequences that compute tokens before the end of their last image run.
            mm = np.flatnonzero(starts < ib.mm_end[rows])
            batch.mm_spans = [(ib.row_states[rows[i]], int(starts[i]), int(counts[i]), int(qsl[i]))
                              for i in mm.tolist()]
        return batch

    def _forward_logits(self, batch: ForwardBatch) -> torch.Tensor | None:
        meta = batch.meta
        num_seqs = meta.num_seqs
        # Graphs hold the LoRA delta (its layout is in static buffers, written by prepare); decode
        # graphs also exist without it, for steps where no token has an adapter.
        lora = self.lora is not None and self.lora.active
        eagle = getattr(self.drafter, "uses_target_hidden", False)  # an EAGLE head keeps the target's features
        if (self.graphs is not None and meta.is_pure_decode and batch.inputs_embeds is None
                and batch.prompt_logprobs is None
                and batch.input_ids.shape[0] == num_seqs
                and len(batch.sample_requests) == num_seqs and self.graphs.padded_size(num_seqs) is not None):
            self.steps_by_path["decode_graph"] += 1
            logits = self.graphs.run(num_seqs, batch.input_ids, batch.positions, meta, lora)
            if eagle:
                self.drafter.saw(None, self.graphs.features[:num_seqs])
            return logits
        ctx, features = ForwardContext(meta, self.backend), None
        if (self.piecewise is not None and (batch.inputs_embeds is None or self.piecewise.accepts_embeds)
                and self.piecewise.padded_size(batch.input_ids.shape[0]) is not None):
            self.steps_by_path["piecewise"] += 1
            hidden = self.piecewise.run(batch.input_ids, batch.positions, ctx, batch.inputs_embeds)
            features = self.piecewise.aux_features(hidden.shape[0])
        else:
            self.steps_by_path["eager"] += 1
            with forward_context(ctx):
                if eagle:
                    hidden = self.drafter.target_forward(self.model, batch.input_ids, batch.positions)
                elif batch.inputs_embeds is None:
                    hidden = self.model(batch.input_ids, batch.positions)
                else:
                    hidden = self.model(batch.input_ids, batch.positions, batch.inputs_embeds)
        if eagle:
            self.drafter.saw(hidden, features)
        if batch.prompt_logprobs is not None:
            batch.prompt_logprobs_out = compute_prompt_logprobs(self.model, hidden, batch.prompt_logprobs,
                                                                self.config.model.vocab_size)
        if not batch.sample_requests:
            return None
        return self.model.compute_logits(hidden[batch.logits_indices])

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, inflight: InFlightStep | None = None) -> InFlightStep:
        """Enqueues the step (inputs, model, sampler, copies of the results to the host) without
        waiting for the device; `collect` waits for the results."""
        step_no = self.num_launched
        batch = self.prepare(sched, inflight)
        self.num_launched += 1
        if self.encdec is not None:
            self.encdec.prepare(sched, batch.meta, self.input_batch)
        if self.mm is not None and batch.mm_spans:
            batch.inputs_embeds = self.mm.step_embeddings(batch.mm_spans, batch.input_ids)
        step = InFlightStep(sched, batch.sample_requests, step_no, verify=batch.verify, drafts=batch.drafts,
                            propose=self._proposes(batch, sched))
        logits = self._forward_logits(batch)
        if getattr(self.drafter, "uses_target_hidden", False):  # an EAGLE head: its cache is filled at collect
            step.eagle = self.drafter.keep(self.input_batch, sched, batch)
        elif self.drafter is not None:  # its cache follows the target's
            self.drafter.run_step(batch.input_ids, batch.positions, batch.meta)
        if self.mm is not None:  # images of waiting requests, encoded beside this step's forward
            self.mm.prefetch(sched)
        if batch.prompt_logprobs_out is not None:
            step.prompt_logprobs = (batch.prompt_logprobs,
                                    tuple(x.to("cpu", non_blocking=True) for x in batch.prompt_logprobs_out))
        elif logits is None:
            return step
        if logits is not None and sched.grammar is not None and sched.grammar.bitmask is None:
            batch.sampling_metadata.grammar_after_launch = True
            step.awaiting_mask = (logits, batch.sampling_metadata)  # `sample` finishes the step
            # known before it samples; drafts are proposed from the step's tokens, which the next
            # step's schedule needs: such a step is collected before the next one is launched
            step.needs_sync = batch.sampling_metadata.needs_host_tokens or step.propose
            return step
        if logits is not None:
            self._sample(step, logits, batch.sampling_metadata)
        self._record_done(step)
        return step

    @torch.inference_mode()
    def sample(self, step: InFlightStep, bitmask: torch.Tensor) -> None:
        """Finishes a step launched without its grammar masks (`GrammarBitmask.bitmask` None): the
        core fills them while the device runs the forward, then the sampler is enqueued here."""
        logits, meta = step.awaiting_mask
        step.awaiting_mask = None
        meta.grammar_bitmask = bitmask
        self._sample(step, logits, meta)
        self._record_done(step)

    def _proposes(self, batch: ForwardBatch, sched: SchedulerOutput) -> bool:
        """Whether drafts are proposed from this step's tokens: the scheduler's plan asks for them
        (speculation on, below disable_by_batch_size, and drafts expected to pay: core/spec_control.py)."""
        return self.spec is not None and bool(batch.sample_requests) and sched.spec_propose

    def _sample(self, step: InFlightStep, logits: torch.Tensor, meta) -> None:
        if step.verify is not None:
            q = None if self.drafter is None else self.drafter.draft_probs(
                step.sample_requests, step.drafts, step.verify, logits.shape[1])
            out = self.verifier(logits, meta, step.verify, q)
            step.token_ids = out.first_token
            step.needs_sync = True  # the verified tokens decide the next step's inputs and drafts
            step.host = tuple(x.to("cpu", non_blocking=True) if x is not None else None
                              for x in (out.first_token, out.logprobs, out.logprob_ids, out.logprob_ranks,
                                        out.num_accepted, out.next_token))
            return
        out = self.sampler(logits, meta)
        step.token_ids = out.token_ids
        step.needs_sync = out.needs_host_tokens or step.propose
        # Device-to-host copies with non_blocking land in pinned memory, asynchronously.
        step.host = tuple(x.to("cpu", non_blocking=True) if x is not None else None
                          for x in (out.token_ids, out.logprobs, out.logprob_ids, out.logprob_ranks))

    def _record_done(self, step: InFlightStep) -> None:
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()

    def collect(self, step: InFlightStep) -> StepResult:
        """Waits for a launched step, records its sampled tokens in the persistent batch and returns
        them (and logprobs) by request id."""
        result = self._collect(step)
        if step.eagle is not None:  # the head's cache over the verified positions, then its drafts
            drafts = self.drafter.fill_and_propose(self.input_batch, step, step.propose)
            if step.propose:
                result.draft_token_ids = drafts
        return result

    def _collect(self, step: InFlightStep) -> StepResult:
        assert step.awaiting_mask is None, "a step collected before its grammar masks were given"
        if step.token_ids is None and step.prompt_logprobs is None:
            return StepResult({}, {})
        if step.done is not None:
            step.done.synchronize()
        prompt = prompt_logprobs_by_request(step.prompt_logprobs[0], *step.prompt_logprobs[1]) \
            if step.prompt_logprobs is not None else {}
        if step.token_ids is None:
            return StepResult({}, {}, prompt_logprobs=prompt)
        if step.verify is not None:
            return self._collect_verified(step, prompt)
        token_ids, logprob_vals, logprob_ids, logprob_ranks = step.host
        tokens = token_ids.tolist()
        states = step.sample_requests
        self.input_batch.record_sampled(states, tokens)
        logprobs, ranks = {}, {}
        if logprob_vals is not None:
            vals, tok_ids, all_ranks = logprob_vals.tolist(), logprob_ids.tolist(), logprob_ranks.tolist()
            for i, r in enumerate(states):
                k = r.sampling_params.logprobs
                if k is not None:
                    entry = {tok_ids[i][0]: vals[i][0]}
                    for t, v in zip(tok_ids[i][1:1 + k], vals[i][1:1 + k]):
                        entry.setdefault(t, v)
                    logprobs[r.req_id] = entry
                    ranks[r.req_id] = all_ranks[i]
        result = StepResult(dict(zip([r.req_id for r in states], tokens)), logprobs, ranks, prompt)
        if step.propose:
            result.draft_token_ids = self._propose(states)
        return result

    def _collect_verified(self, step: InFlightStep, prompt: dict) -> StepResult:
        result = StepResult({}, {}, prompt_logprobs=prompt)
        collect_verified(result, self.input_batch, step)
        if step.propose:
            result.draft_token_ids = self._propose(step.sample_requests)
        return result

    def _propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        return propose_drafts(self.input_batch, states, self.drafter, self.proposer)
