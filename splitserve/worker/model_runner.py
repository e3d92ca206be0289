"""Turns a scheduler decision into one forward pass: flat inputs, attention metadata, model, sampler.

The runner decides no policy. It reads, for each scheduled request, its tokens from
num_computed_tokens on and its block ids, and lays them out as one ragged batch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.attention.backend import AttentionMetadata, get_backend
from splitserve.attention.layer import ForwardContext, forward_context
from splitserve.config import EngineConfig
from splitserve.core.scheduler import SchedulerOutput
from splitserve.layers.sampler import Sampler
from splitserve.request import Request

logger = logging.getLogger(__name__)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # [S] rows of the hidden states whose next token is sampled
    sample_requests: list[Request]  # the S requests that sample this step, in row order


@dataclass
class StepResult:
    tokens: dict[str, int]
    logprobs: dict[str, dict[int, float]]


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module):
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.backend = get_backend(config.attention_backend)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = -(-config.model.max_model_len // self.block_size)

    # -- KV cache --------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        m = self.config.model
        elem = torch.empty((), dtype=m.dtype).element_size()
        return 2 * self.block_size * m.num_kv_heads * m.head_dim * elem * m.num_layers

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
                sched.max_num_seqs * m.vocab_size * 4 * 4 + (512 << 20)
            budget = total * cache.gpu_memory_utilization - (total - free) - act
        else:
            budget = cache.cpu_kv_cache_gib * (1 << 30)
        num_blocks = int(budget // self.bytes_per_block())
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache; lower the model size or raise gpu_memory_utilization")
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.config.model
        shape = (num_blocks, 2, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=m.dtype, device=self.device) for _ in range(m.num_layers)]
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.bytes_per_block() / (1 << 30))

    # -- one step --------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> ForwardBatch:
        bs = self.block_size
        num_seqs = len(sched.scheduled)
        counts = np.fromiter((n for _, n in sched.scheduled), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((r.num_computed_tokens for r, _ in sched.scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = starts + counts
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        total = int(query_start_loc[-1])

        input_ids = np.empty(total, dtype=np.int64)
        block_tables = np.zeros((num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        sample_requests, logits_indices = [], []
        for i, (request, n) in enumerate(sched.scheduled):
            s = int(starts[i])
            input_ids[query_start_loc[i]:query_start_loc[i + 1]] = request.token_slice(s, s + n)
            block_tables[i, :len(request.block_ids)] = request.block_ids
            if s + n == request.num_tokens:
                sample_requests.append(request)
                logits_indices.append(int(query_start_loc[i + 1]) - 1)

        # position of every token = its sequence's start + offset within the step's chunk
        seq_index = np.repeat(np.arange(num_seqs), counts)
        positions = starts[seq_index] + (np.arange(total) - query_start_loc[:-1][seq_index])
        slot_mapping = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs

        dev = self.device
        qsl_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        max_blocks = int(-(-seq_lens.max() // bs))
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            query_start_loc=qsl_cpu.to(dev, non_blocking=True),
            seq_lens=seq_lens_cpu.to(dev, non_blocking=True),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables[:, :max_blocks])).to(dev, non_blocking=True),
            max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu)
        return ForwardBatch(
            input_ids=torch.from_numpy(input_ids).to(dev, non_blocking=True),
            positions=torch.from_numpy(positions).to(dev, non_blocking=True),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long).to(dev, non_blocking=True),
            sample_requests=sample_requests)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        batch = self.prepare(sched)
        with forward_context(ForwardContext(batch.meta, self.kv_caches, self.backend)):
            hidden = self.model(batch.input_ids, batch.positions)
        if not batch.sample_requests:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        out = self.sampler(logits, batch.sample_requests)
        tokens = out.token_ids.tolist()  # the step's one host sync
        ids = [r.request_id for r in batch.sample_requests]
        logprobs = {}
        if out.logprobs is not None:
            vals, tok_ids = out.logprobs.tolist(), out.logprob_ids.tolist()
            for i, r in enumerate(batch.sample_requests):
                k = r.sampling_params.logprobs
                if k is not None:
                    entry = {tok_ids[i][0]: vals[i][0]}
                    for t, v in zip(tok_ids[i][1:1 + k], vals[i][1:1 + k]):
                        entry.setdefault(t, v)
                    logprobs[r.request_id] = entry
        return StepResult(dict(zip(ids, tokens)), logprobs)
