"""The engine core's side of the worker processes (world size > 1): it stands where the in-process
`ModelRunner` stands (`launch`, `collect`, `update_states`), so `EngineCore` steps the same way.

Each step message is encoded once and published to every rank on one ZeroMQ XPUB socket (a copy per
subscriber is zmq's, not ours: no pickle per rank); the sampling rank's `StepDone` comes back on a
PULL socket. On one host the sockets are ipc:// files; with --nnodes > 1 they are tcp:// on
master_addr, ports master_port + 1 (steps) and + 2 (results), which the headless nodes' ranks reach.
Who starts the ranks is the executor's `ranks`: `LocalRanks` (processes of this host, below) or
`RayRanks` (Ray actors over a cluster's nodes, ray_ranks.py; tcp:// on this node's address).

Faults: while it waits the executor watches its local worker processes (a dead one), `RankFailed` /
`RankLost` messages (a rank's exception, a headless node's dead worker), and the clock (a step that
no rank has answered within step_timeout_s is a hung rank). Any of them ends the engine
(`RanksLostError`, which the core turns into its EngineDeadError: the other ranks' collectives cannot line
up again); the
executor stops every local worker first. Workers die with the core's process (PR_SET_PDEATHSIG) and
leave when its sockets disappear, so nothing outlives the engine.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
import weakref
from dataclasses import dataclass

import zmq

from splitserve.config import EngineConfig, ParallelConfig
from splitserve.executor.rank_worker import worker_main
from splitserve.protocol.rank_messages import (CoreToWorker, RankBlocks, RankFailed, RankLost, RankReady, RanksLostError,
                                                    RunStep, StartKV, StepDone, Stop, UpdateStates, WorkerToCore)
from splitserve.protocol.core_messages import Codec
from splitserve.worker.model_runner import StepResult

logger = logging.getLogger(__name__)

_WATCH_MS = 100
_LAST_WORDS_S = 1.0  # how long a dead rank's last message may still be on its way


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Addresses:
    init_method: str   # torch.distributed's rendezvous
    step: str          # where ranks connect for step messages
    result: str        # where ranks connect to answer
    step_bind: str     # what the core binds
    result_bind: str


def addresses(par: ParallelConfig, ipc_dir: str | None) -> Addresses:
    """One host: ipc:// files in ipc_dir and a free port for torch (unless --master-port). Several:
    tcp:// on master_addr, master_port (+1, +2)."""
    if par.nnodes == 1:
        port = par.master_port or free_port(par.master_addr)
        step, result = f"ipc://{ipc_dir}/steps", f"ipc://{ipc_dir}/results"
        return Addresses(f"tcp://{par.master_addr}:{port}", step, result, step, result)
    host, port = par.master_addr, par.master_port
    try:
        bind_host = socket.gethostbyname(host)
    except OSError:
        bind_host = "*"
    return Addresses(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}", f"tcp://{host}:{port + 2}",
                     f"tcp://{bind_host}:{port + 1}", f"tcp://{bind_host}:{port + 2}")


def local_ranks(par: ParallelConfig) -> list[int]:
    per_node = par.world_size // par.nnodes
    return list(range(par.node_rank * per_node, (par.node_rank + 1) * per_node))


def check_devices(par: ParallelConfig, device: str) -> None:
    if device.startswith("cuda"):
        import torch
        need, have = par.world_size // par.nnodes, torch.cuda.device_count()
        if have < need:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size / nnodes = {need} ranks on this host "
                             f"need {need} GPUs; {have} visible")


def start_workers(config: EngineConfig, addrs: Addresses) -> dict[int, multiprocessing.Process]:
    spawn = multiprocessing.get_context("spawn")
    procs = {}
    level = logging.getLogger().level
    for local_rank, rank in enumerate(local_ranks(config.parallel)):
        p = spawn.Process(target=worker_main, name=f"splitserve-rank-{rank}",
                          args=(config, rank, local_rank, addrs.init_method, addrs.step, addrs.result, os.getpid(), level))
        p.start()
        procs[rank] = p
    return procs


def stop_processes(procs, timeout: float = 5.0) -> None:
    """Waits for processes told to stop, then kills what is left."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def describe_exit(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        hint = " (the kernel's out-of-memory killer?)" if -code == signal.SIGKILL else ""
        return f"rank {rank} was killed by {name}{hint}"
    return f"rank {rank} exited with code {code}"


class LocalRanks:
    """The ranks of this host, one process each (multiprocessing, spawn); --nnodes > 1 has the other
    hosts' ranks started by their own `splitserve serve --node-rank` (launcher.py). executor/ray_ranks.py
    is the other kind: Ray actors. The executor asks a kind for its addresses, starts it, asks which
    ranks have died, and stops it."""

    def __init__(self, config: EngineConfig):
        par = config.parallel
        if par.node_rank != 0:
            raise ValueError(f"node_rank {par.node_rank}: the engine runs on node 0; on the other nodes "
                             f"`splitserve serve --node-rank {par.node_rank} ...` starts their ranks only")
        check_devices(par, config.device)
        self.config = config
        self.procs: dict[int, multiprocessing.Process] = {}
        self.placement = f"{par.nnodes} node(s)"

    def addresses(self, ipc_dir: str) -> Addresses:
        return addresses(self.config.parallel, ipc_dir)

    def start(self, addrs: Addresses) -> None:
        self.procs.update(start_workers(self.config, addrs))

    def dead(self) -> list[str]:
        """Why each rank that has exited is gone (none: all alive)."""
        return [describe_exit(rank, p.exitcode) for rank, p in self.procs.items() if not p.is_alive()]

    def stop(self, timeout: float = 5.0) -> None:
        stop_processes(list(self.procs.values()), timeout=timeout)


class _RemoteStep:
    """A step sent to the ranks; `collect` waits for its StepDone. For the core it is an InFlightStep:
    with async scheduling the next step is sent before this one is collected. Each rank finishes a
    step (its tokens recorded in its persistent batch) before it reads the next message, so a rank
    never runs on a pending token: only the core's grammars need a step's tokens before the next
    one is scheduled (its next masks)."""
    sample_requests = None  # the ranks know them; the core cannot check the count here
    awaiting_mask = None  # the ranks get a step's grammar masks with it, never after

    def __init__(self, sched, step_no: int):
        self.sched, self.step_no = sched, step_no
        # (speculative decoding: a verify step's tokens and drafts decide the next step's inputs)
        self.needs_sync = sched.grammar is not None or sched.spec_propose or bool(sched.spec_token_ids)


def _kv_free_window(hf_config) -> int | None:
    """The window after which a request's blocks can go, from the config as the decoder reads its
    windows (the model itself is in the ranks' processes)."""
    from splitserve.models.families import decoder_spec
    try:
        windows = decoder_spec(getattr(hf_config, "text_config", None) or hf_config).windows
    except (AttributeError, ValueError):
        return None
    return None if not windows or None in windows else max(windows)


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, ranks=None):
        """`ranks`: who starts the rank processes (LocalRanks, or a RayRanks of executor/ray_ranks.py)."""
        par = self.par = config.parallel
        self.ranks = ranks if ranks is not None else LocalRanks(config)
        self.kv_caches = None  # the KV pool lives in the rank processes (a producer's ranks serve it: kv_transfer/tcp.py)
        self.lora = None  # LoRA: the core's manager here; each rank attaches its own slots (rank_worker.py)
        if config.lora is not None:
            from splitserve.lora.manager import build_manager
            # Not pinned: the adapters leave this process encoded in the step message.
            self.lora = build_manager(config, pin_memory=False)
        self.model = self.runner = None  # in the ranks' processes
        self.kv_free_window = _kv_free_window(config.model.hf_config)
        self.world = par.world_size
        self.step_timeout_s = par.step_timeout_s
        self._ipc_dir = tempfile.mkdtemp(prefix="splitserve-ranks-")
        try:
            self.addrs = self.ranks.addresses(self._ipc_dir)
        except BaseException:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self.ranks.stop(0)
            raise
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every rank's subscription, not only the first
        self.pub.setsockopt(zmq.LINGER, 2000)     # Stop reaches the ranks after we return
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        for sock, addr in ((self.pub, self.addrs.step_bind), (self.pull, self.addrs.result_bind)):
            try:
                sock.bind(addr)
            except zmq.ZMQError as e:
                self.ctx.destroy(linger=0)
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
                self.ranks.stop(0)
                raise ValueError(f"cannot listen on {addr} for the ranks: {e} (is --master-addr an address of "
                                 f"this host, and are --master-port + 1 and + 2 free?)") from None
        self._encode = Codec(CoreToWorker).encode
        self._decoder = Codec(WorkerToCore)
        self._num_launched = 0
        self._dead: str | None = None
        self._finalizer = weakref.finalize(self, _cleanup, self.ranks, self.ctx, self._ipc_dir)
        try:
            self.ranks.start(self.addrs)
            deadline = time.monotonic() + par.distributed_timeout_s
            self._wait_subscribers(deadline)
            blocks = self._gather(RankBlocks, deadline, "start-up")
            self.num_blocks = min(m.num_blocks for m in blocks)
            logger.info("%d ranks up (tp %d x pp %d over %s); KV blocks per rank: %s, using %d", self.world,
                        par.tensor_parallel_size, par.pipeline_parallel_size, self.ranks.placement,
                        sorted(m.num_blocks for m in blocks), self.num_blocks)
            self.pub.send(self._encode(StartKV(self.num_blocks)))
            self._gather(RankReady, deadline, "start-up")
        except BaseException:
            self.shutdown()
            raise

    # -- waiting on the ranks --------------------------------------------------------------------
    def _check_procs(self, phase: str) -> None:
        dead = self.ranks.dead()
        if dead:
            # A rank that failed sends why before it exits, but the message can still be in flight
            # when the exit is seen: give it a moment so the error names the cause, not the exit code.
            deadline = time.monotonic() + _LAST_WORDS_S
            while self.pull.poll(max(0, int(1000 * (deadline - time.monotonic())))):
                msg = self._decoder.decode(self.pull.recv())
                if isinstance(msg, (RankFailed, RankLost)):
                    self._unexpected(msg, phase)
            raise RuntimeError(f"{dead[0]} during {phase}")

    def _wait_subscribers(self, deadline: float) -> None:
        joined = 0
        while joined < self.world:
            if self.pub.poll(_WATCH_MS):
                if self.pub.recv()[:1] == b"\x01":
                    joined += 1
                continue
            self._poll_failures("start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {joined} of {self.world} ranks connected within "
                                   f"{self.par.distributed_timeout_s} s (are the other nodes started?)")

    def _poll_failures(self, phase: str) -> None:
        while self.pull.poll(0):
            self._unexpected(self._decoder.decode(self.pull.recv()), phase)
        self._check_procs(phase)

    def _unexpected(self, msg, phase: str):
        if isinstance(msg, RankFailed):
            raise RuntimeError(msg.error if msg.startup else f"{msg.error} (during {phase})")
        if isinstance(msg, RankLost):
            raise RuntimeError(f"{msg.why} (during {phase})")
        raise RuntimeError(f"unexpected {type(msg).__name__} from the ranks during {phase}")

    def _gather(self, kind, deadline: float, phase: str) -> list:
        got: dict[int, object] = {}
        while len(got) < self.world:
            if self.pull.poll(_WATCH_MS):
                msg = self._decoder.decode(self.pull.recv())
                if isinstance(msg, kind):
                    got[msg.rank] = msg
                else:
                    self._unexpected(msg, phase)
                continue
            self._check_procs(phase)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - set(got))
                raise RuntimeError(f"ranks {missing} did not finish {phase} within {self.par.distributed_timeout_s} s")
        return list(got.values())

    # -- the runner's interface ------------------------------------------------------------------
    def _send(self, msg) -> None:
        if self._dead is not None:
            raise RanksLostError(self._dead)
        self.pub.send(self._encode(msg), copy=False)

    def launch(self, sched, inflight=None) -> _RemoteStep:
        self._send(RunStep(sched))
        step = _RemoteStep(sched, self._num_launched)
        self._num_launched += 1
        return step

    def update_states(self, sched) -> None:
        if self._dead is None:  # after a loss there is nobody to tell (the engine is failing its requests)
            self._send(UpdateStates(sched))

    def collect(self, step: _RemoteStep) -> StepResult:
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            if self.pull.poll(_WATCH_MS):
                msg = self._decoder.decode(self.pull.recv(copy=False).buffer)
                if isinstance(msg, StepDone):
                    if msg.step_no == step.step_no:
                        return StepResult(msg.tokens, msg.logprobs, msg.logprob_ranks,
                                          more_tokens=msg.more_tokens, more_logprobs=msg.more_logprobs,
                                          more_logprob_ranks=msg.more_logprob_ranks,
                                          draft_token_ids=msg.draft_token_ids)
                    if msg.step_no < step.step_no:
                        continue  # a step whose wait was given up on
                    self._lose(f"the sampling rank answered step {msg.step_no} while step {step.step_no} was awaited")
                try:
                    self._unexpected(msg, f"step {step.step_no}")
                except RuntimeError as e:
                    self._lose(str(e))
            dead = self.ranks.dead()
            if dead:
                self._lose(dead[0])
            if time.monotonic() > deadline:
                self._lose(f"no answer to step {step.step_no} within step_timeout_s={self.step_timeout_s:g} s "
                           f"(a hung rank?)")

    def check_alive(self) -> None:
        """Between steps: a rank that died or failed meanwhile ends the engine now, not at the next step."""
        if self._dead is not None:
            raise RanksLostError(self._dead)
        while self.pull.poll(0):
            msg = self._decoder.decode(self.pull.recv())
            try:
                self._unexpected(msg, "an idle moment")
            except RuntimeError as e:
                self._lose(str(e))
        dead = self.ranks.dead()
        if dead:
            self._lose(dead[0])

    def _dead_ranks(self, wait_s: float) -> list[str]:
        """The local ranks that have exited, waiting up to wait_s for one (a rank's error is often the
        echo of a peer's death: its collective broke)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = self.ranks.dead()
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _lose(self, why: str):
        dead = self._dead_ranks(wait_s=1.0)
        if dead and dead[0] not in why:
            why = f"{'; '.join(dead)} ({why})"
        logger.error("the ranks cannot go on: %s; stopping every rank", why)
        self._dead = why
        self.shutdown()
        raise RanksLostError(why)

    # -- start-up of the single-process runner: nothing to do here -----------------------------------
    def setup_fast_path(self) -> None:
        pass

    def shutdown(self) -> None:
        """Tells the ranks to stop, waits a moment, kills what is left (idempotent)."""
        if self._finalizer.alive:
            try:
                self.pub.send(self._encode(Stop()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._finalizer()


def _cleanup(ranks, ctx: zmq.Context, ipc_dir: str) -> None:
    ranks.stop(timeout=5.0)
    ctx.destroy(linger=500)
    shutil.rmtree(ipc_dir, ignore_errors=True)
