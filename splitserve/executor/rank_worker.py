"""One worker process per rank (world size > 1): joins the ranks, builds this rank's part of the model,
then runs every step message the engine core broadcasts.

Start-up: `init_model_parallel` (gloo on CPU, NCCL on CUDA with device cuda:<local rank>), the model
(`load_model`, which picks up this rank's groups), a `StageRunner`, the KV-cache blocks this rank can
hold (`RankBlocks`; the core takes the smallest and answers `StartKV`), then the KV cache and the fast
path (`RankReady`). A failure says which rank failed, and how much memory it asked for when it ran out.

Each step every rank applies the message to its own persistent batch and runs its stage; the last
stage's tensor-parallel rank 0 alone samples (the others of that stage hold the same logits, but
nobody else needs them), broadcasts the sampled ids to every rank (each records them in its
persistent batch: the next step's inputs), and sends the step's tokens and logprobs to the core.
Each step is collected before the next message is read, so a rank never holds a pending token; the
core may still send step N+1 before it has N's answer (async scheduling): the message waits in the
socket while the rank finishes N, and the core's scheduling overlaps the ranks' work.

The process dies with its parent (PR_SET_PDEATHSIG), and leaves when the core's sockets go away (a
core on another host) or its parent's pid changes.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import time
import traceback

import torch
import torch.distributed as dist
import zmq

from splitserve.config import EngineConfig
from splitserve.executor.seeding import seed_everything
from splitserve.parallel.parallel_state import init_model_parallel, pp_group, tp_group
from splitserve.parallel.pipeline import recv_intermediate, send_intermediate, stage_forward
from splitserve.protocol.rank_messages import (CoreToWorker, RankBlocks, RankFailed, RankReady, RunStep, StartKV,
                                                    StepDone, Stop, UpdateStates, WorkerToCore)
from splitserve.protocol.core_messages import Codec
from splitserve.worker.model_runner import InFlightStep, ModelRunner, StepResult

logger = logging.getLogger(__name__)

_POLL_MS = 500


class StageRunner(ModelRunner):
    """The model runner of one rank: the same step as the single-process runner, plus the pipeline
    transfer between stages and the sampled ids shared by the sampling rank."""

    def __init__(self, config, model, sampler_rank: int, lora=None):
        super().__init__(config, model, lora)
        self.tp, self.pp = tp_group(), pp_group()
        self.sampler_rank = sampler_rank
        self.samples = dist.get_rank() == sampler_rank if dist.is_initialized() else True
        if self.encdec is not None and self.pp.world_size > 1:
            # the encoder and every decoder layer's cross K/V would have to live on one stage
            raise ValueError("encoder-decoder models run with tensor parallelism only; "
                             "use pipeline_parallel_size 1")

    def setup_fast_path(self) -> None:
        if self.pp.world_size > 1:  # stages run eagerly: the graphs capture whole models
            return
        super().setup_fast_path()

    def one_row_graph(self) -> bool:
        # The graphs hold the ranks' collectives, so every rank must pad a step to the same size;
        # which layers take the GEMV (symmetric parts of the checkpoint) may differ between ranks.
        asks = super().one_row_graph()
        if self.tp.world_size == 1:
            return asks
        flag = torch.tensor([int(asks)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.tp.group)
        return bool(flag.item())

    def _stage_logits(self, batch) -> torch.Tensor | None:
        pp = self.pp
        if pp.world_size == 1:
            return self._forward_logits(batch)
        from splitserve.attention.layer import ForwardContext, forward_context
        intermediate = None
        if not pp.is_first:
            intermediate = recv_intermediate(batch.input_ids.shape[0], self.config.model.hf_config.hidden_size,
                                             self.config.model.dtype, self.device, pp.ranks[pp.rank - 1])
        with forward_context(ForwardContext(batch.meta, self.backend)):
            out = stage_forward(self.model, batch.input_ids, batch.positions, batch.inputs_embeds, intermediate,
                                pp.is_last)
        if not pp.is_last:
            send_intermediate(out, pp.ranks[pp.rank + 1])
            return None
        if not batch.sample_requests:
            return None
        return self.model.compute_logits(out[batch.logits_indices])

    @torch.inference_mode()
    def launch(self, sched, inflight: InFlightStep | None = None) -> InFlightStep:
        step_no = self.num_launched
        batch = self.prepare(sched, inflight)
        self.num_launched += 1
        if self.encdec is not None:  # every rank runs the encoders, storing its heads' cross K/V
            self.encdec.prepare(sched, batch.meta, self.input_batch)
        if self.mm is not None and batch.mm_spans and self.pp.is_first:
            batch.inputs_embeds = self.mm.step_embeddings(batch.mm_spans, batch.input_ids)
        # (speculative decoding: drafts proposed on the sampling rank only, whose answer the core reads)
        step = InFlightStep(sched, batch.sample_requests, step_no, verify=batch.verify, drafts=batch.drafts,
                            propose=self.samples and self._proposes(batch, sched))
        logits = self._stage_logits(batch)
        num_samples = len(batch.sample_requests)
        if num_samples == 0:
            return step
        if batch.verify is not None:
            return self._verify(step, logits, batch, num_samples)
        if self.samples:
            out = self.sampler(logits, batch.sampling_metadata)
            token_ids, rest = out.token_ids, (out.logprobs, out.logprob_ids, out.logprob_ranks)
        else:
            token_ids, rest = torch.empty(num_samples, dtype=torch.long, device=self.device), (None, None, None)
        dist.broadcast(token_ids, self.sampler_rank)
        step.token_ids = token_ids
        step.host = tuple(x.to("cpu") if x is not None else None for x in (token_ids, *rest))
        return step


    def _verify(self, step: InFlightStep, logits, batch, num_samples: int) -> InFlightStep:
        """A verify step: the sampling rank decides (layers/rejection_sampler.py; n-gram drafts, so no
        q) and broadcasts each sequence's first token, accepted count and next token to every rank,
        which records them at collect (worker/spec_decode.collect_verified)."""
        if self.samples:
            out = self.verifier(logits, batch.sampling_metadata, batch.verify, None)
            packed = torch.stack([out.first_token, out.num_accepted, out.next_token])
            rest = (out.logprobs, out.logprob_ids, out.logprob_ranks)
        else:
            packed, rest = torch.empty((3, num_samples), dtype=torch.long, device=self.device), (None, None, None)
        dist.broadcast(packed, self.sampler_rank)
        step.token_ids = packed[0]
        host = packed.to("cpu")
        step.host = (host[0], *(x.to("cpu") if x is not None else None for x in rest), host[1], host[2])
        return step


class RankWorker:
    """Everything one rank holds: its groups, its part of the model, its runner and KV cache."""

    def __init__(self, config: EngineConfig, rank: int, local_rank: int, init_method: str,
                 fault: tuple[int, str] | None = None):
        from splitserve.models.loader import load_model
        self.rank, self.fault, self.seed = rank, fault, config.seed
        par = config.parallel
        device = config.device
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            backend = "gloo"
            # The host's cores are shared by the ranks on it.
            ranks_here = par.world_size // par.nnodes * par.data_parallel_size  # data-parallel replicas' too
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
        self.device = device
        config = dataclasses.replace(config, device=device)
        self.config = config
        init_model_parallel(tp_size=par.tensor_parallel_size, pp_size=par.pipeline_parallel_size, rank=rank,
                            backend=backend, init_method=init_method, timeout_s=par.distributed_timeout_s)
        if fault is not None and fault[1] == "startup_oom":
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 GiB (injected on rank {rank})")
        m = config.model
        _, model = load_model(config.load.source, m.hf_config, m.dtype, device, config.load.random_weights, m.quant_config,
                              m.max_model_len)
        lora = None
        if config.lora is not None:  # this rank's slots, loaded from the step messages' slot loads
            from splitserve.lora.worker import build_worker
            lora = build_worker(config, model)
        # The last stage's tensor-parallel rank 0 samples.
        sampler_rank = (par.pipeline_parallel_size - 1) * par.tensor_parallel_size
        self.runner = StageRunner(config, model, sampler_rank, lora)
        self.num_blocks = self.runner.determine_num_blocks()

    def start(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        kv = self.config.kv_transfer
        if kv is not None and kv.is_producer:  # a tensor-parallel producer: this rank serves its heads
            from splitserve.kv_transfer.pool import KVPool
            from splitserve.kv_transfer.tcp import BlockServer
            self.block_server = BlockServer(KVPool(self.runner.kv_caches), kv.kv_ip, kv.kv_port + 1 + self.rank)
        self.runner.setup_fast_path()
        gc.freeze()
        if self.seed is not None:  # as the in-process runner (unseeded draws repeat)
            seed_everything(self.seed)

    def run(self, sched) -> StepResult:
        step = self.runner.launch(sched)
        if self.fault is not None and self.fault[0] == self.runner.num_launched:
            _inject(self.fault[1], self.rank)
        return self.runner.collect(step)


def _inject(kind: str, rank: int) -> None:
    logger.warning("rank %d: injected fault %s", rank, kind)
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")


def describe_startup_error(exc: BaseException, rank: int, device: str) -> str:
    """One line naming the rank; for an out-of-memory error, the memory asked for (torch's message
    says "Tried to allocate X"; the CPU allocator "you tried to allocate N bytes")."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text.lower():
        return f"rank {rank} ({device}) ran out of memory at start-up: {first}"
    return f"rank {rank} ({device}) failed at start-up: {type(exc).__name__}: {first}"


def connect_worker_sockets(ctx: zmq.Context, step_addr: str, result_addr: str):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sub.connect(step_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(result_addr)
    return sub, monitor, push


class CoreWatch:
    """Tells when the engine core is gone: its socket's connection dropped, or our parent changed (no
    parent to watch under Ray: parent_pid None)."""

    def __init__(self, monitor: zmq.Socket, parent_pid: int | None):
        from zmq.utils.monitor import recv_monitor_message
        self._recv = recv_monitor_message
        self.monitor, self.parent_pid, self.connected = monitor, parent_pid, False

    def gone(self) -> bool:
        while self.monitor.poll(0):
            event = self._recv(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                return True
        return self.parent_pid is not None and os.getppid() != self.parent_pid


def worker_main(config: EngineConfig, rank: int, local_rank: int, init_method: str, step_addr: str, result_addr: str,
                parent_pid: int, log_level: int) -> None:
    """Entry point of a worker process (multiprocessing, spawn)."""
    from splitserve.process_lifetime import die_with_parent, flush_and_exit
    die_with_parent()
    if os.getppid() != parent_pid:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the core decides
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s")
    ctx = zmq.Context()
    flush_and_exit(ctx, rank_loop(ctx, config, rank, local_rank, init_method, step_addr, result_addr, parent_pid))


def rank_loop(ctx: zmq.Context, config: EngineConfig, rank: int, local_rank: int, init_method: str, step_addr: str,
              result_addr: str, parent_pid: int | None) -> int:
    """One rank from start-up to its end: the exit status (0 after the core's Stop). The same for a
    worker process and a Ray actor (executor/ray_ranks.py), which calls it without a parent to watch."""
    from splitserve.fault_injection import rank_fault
    sub, monitor, push = connect_worker_sockets(ctx, step_addr, result_addr)
    watch = CoreWatch(monitor, parent_pid)
    encode = Codec(WorkerToCore).encode
    decoder = Codec(CoreToWorker)
    device = f"cuda:{local_rank}" if config.device.startswith("cuda") else config.device
    try:
        worker = RankWorker(config, rank, local_rank, init_method, rank_fault(rank))
    except BaseException as e:
        logger.error("rank %d failed to start:\n%s", rank, traceback.format_exc())
        push.send(encode(RankFailed(rank, describe_startup_error(e, rank, device), startup=True)))
        return 1
    push.send(encode(RankBlocks(rank, worker.num_blocks)))
    code = 0
    try:
        while True:
            if not sub.poll(_POLL_MS):
                if watch.gone():
                    logger.error("rank %d: the engine core is gone; exiting", rank)
                    code = 1
                    break
                continue
            msg = decoder.decode(sub.recv(copy=False).buffer)
            if isinstance(msg, RunStep):
                result = worker.run(msg.sched)
                if worker.runner.samples:
                    push.send(encode(StepDone(worker.runner.num_launched - 1, result.tokens, result.logprobs,
                                              result.logprob_ranks, result.more_tokens, result.more_logprobs,
                                              result.more_logprob_ranks, result.draft_token_ids)))
            elif isinstance(msg, UpdateStates):
                worker.runner.update_states(msg.sched)
            elif isinstance(msg, StartKV):
                worker.start(msg.num_blocks)
                push.send(encode(RankReady(rank)))
            elif isinstance(msg, Stop):
                break
    except BaseException as e:
        logger.error("rank %d failed:\n%s", rank, traceback.format_exc())
        push.send(encode(RankFailed(rank, f"rank {rank} ({device}) failed: {type(e).__name__}: {e}")))
        code = 1
    return code
