"""The engine cores behind one front: where each runs, how the front reaches it, and what the front
knows of it.

A `CorePlacement` is one core's two ZeroMQ sockets (bound by the front) and the process or thread
that runs the core loop (core_loop.py). A `Replica` is one engine core of a data-parallel server:
its placement, the receiver thread that hands its step messages to the event loop, the counters it
reports every step and the requests the front routed to it. With `--data-parallel-size 1` there is
one replica, and the server is what it always was.

GPUs: replica i runs on its own set of tp*pp devices (`replica_devices`). Fewer GPUs than
dp*tp*pp is allowed only when the replicas that share a GPU fit in it together: their
--gpu-memory-utilization adds up to at most 1 (two replicas at 0.45 on one H200, say).
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import os
import shutil
import tempfile
import threading
from typing import Callable

import zmq

from splitserve.config import EngineConfig, ParallelConfig
from splitserve.protocol.core_messages import Codec, CoreReady, CoreToFront, EngineCoreOutputs, SchedulerStats

logger = logging.getLogger(__name__)

# How often a receiver thread looks at its core when no message comes.
WATCH_INTERVAL_MS = 200


class _ProcessHost:
    """A core in a process of this host (spawned: a fresh interpreter, CUDA untouched)."""

    def __init__(self, process: multiprocessing.Process):
        self.process = process

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def exit_description(self) -> str:
        return f"the engine core process died (exit code {self.process.exitcode})"

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def join(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.kill()


class CorePlacement:
    """Where one core runs and how the front reaches it: two sockets the front binds, and the core's
    host: a process of this machine, a Ray actor on any node of a cluster (`--data-parallel-backend
    ray`: the sockets are then tcp:// on an address the nodes reach), or a thread (tests)."""

    def __init__(self, tcp_host: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="splitserve-")
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        # Never block on a busy core (no high-water mark); a send waits only while the core has not
        # connected yet (a core thread just started), and never longer than this.
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.setsockopt(zmq.SNDTIMEO, 5000)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        if tcp_host is None:
            self.input_addr = f"ipc://{self.dir}/input"
            self.output_addr = f"ipc://{self.dir}/output"
            self.input.bind(self.input_addr)
            self.output.bind(self.output_addr)
        else:
            self.input_addr = f"tcp://{tcp_host}:{self.input.bind_to_random_port('tcp://*')}"
            self.output_addr = f"tcp://{tcp_host}:{self.output.bind_to_random_port('tcp://*')}"
        self.host = None   # _ProcessHost or executor.ray_core_host.RayCoreHost
        self.thread: threading.Thread | None = None

    def start_process(self, config: EngineConfig, visible_devices: str | None = None) -> None:
        from splitserve.engine.core_loop import core_process_main
        process = multiprocessing.get_context("spawn").Process(
            target=core_process_main, name="splitserve-engine-core",
            args=(config, self.input_addr, self.output_addr, os.getpid(), logging.getLogger().level),
            kwargs={"visible_devices": visible_devices})
        process.start()
        self.host = _ProcessHost(process)

    def start_ray_actor(self, config: EngineConfig, index: int) -> None:
        """Starts the core as a Ray actor, replica `index` of the data-parallel group (Ray chooses its
        node among those with the GPUs it asks for)."""
        from splitserve.engine.core_loop import core_process_main
        from splitserve.executor.ray_core_host import RayCoreHost
        bundle = config.parallel.ray_bundle_resource  # e.g. one slot per node: one replica per node
        self.host = RayCoreHost(config, self.input_addr, self.output_addr, core_process_main,
                                resources=dict([bundle]) if bundle else None, name=f"engine core {index}")
        self.host.start()

    @property
    def pid(self) -> int | None:
        return None if self.host is None else self.host.pid

    def wait_ready(self, timeout: float | None, stop: Callable[[], bool] = lambda: False) -> CoreReady:
        """The core's first message (raises with the core's own start-up error, if it died, or when
        `stop()` turns true: the server is stopping while a replica restarts)."""
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        decoder = Codec(CoreToFront)
        while deadline is None or time.monotonic() < deadline:
            if stop():
                raise RuntimeError("the server is stopping")
            if self.output.poll(WATCH_INTERVAL_MS):
                msg = decoder.decode(self.output.recv())
                if not isinstance(msg, CoreReady):
                    raise RuntimeError(f"the engine core sent {type(msg).__name__} before it was ready")
                if msg.error:
                    raise RuntimeError(f"the engine core failed to start: {msg.error}")
                return msg
            if not self.alive():
                raise RuntimeError(f"{self.exit_description()} while starting")
        raise RuntimeError(f"the engine core was not ready after {timeout} s")

    def alive(self) -> bool:
        if self.host is not None:
            return self.host.alive()
        return self.thread is not None and self.thread.is_alive()

    def exit_description(self) -> str:
        if self.host is not None:
            return self.host.exit_description()
        return "the engine core thread stopped"

    def kill(self) -> None:
        if self.host is not None:
            self.host.kill()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
        if self.host is not None:
            self.host.join(timeout)

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # closes both sockets (a core thread that never ended cannot block this)
        shutil.rmtree(self.dir, ignore_errors=True)


class Replica:
    """One engine core as the front sees it. Its fields are read and written on the event loop
    thread only; the receiver thread only hands messages over."""

    def __init__(self, index: int, placement: CorePlacement, visible_devices: str | None = None,
                 num_blocks: int = 0):
        self.index = index
        self.placement = placement
        self.visible_devices = visible_devices
        self.num_blocks = num_blocks
        self.stats = SchedulerStats()
        self.num_sent = 0              # sequences sent to this core (it reports how many it took in)
        self.requests: set[str] = set()  # ids of the requests routed here that have not finished
        self.num_seqs_in_flight = 0    # their sequences (n each)
        self.num_routed = 0            # requests routed here since the server started
        self.up = True                 # False while it restarts (or after it could not)
        self.restarts = 0
        self.last_error: str | None = None
        self._receiver: threading.Thread | None = None

    def start_receiver(self, on_message: Callable[["Replica", EngineCoreOutputs], None],
                       on_gone: Callable[["Replica", CorePlacement, str], None], stopping: Callable[[], bool]) -> None:
        """Starts a thread that waits on this core's socket: each step message goes to `on_message`,
        and a core that is gone (and was not told to stop) to `on_gone`, both called on that thread
        (the caller hops to its loop)."""
        placement = self.placement

        def receive() -> None:
            decoder = Codec(CoreToFront)
            sock = placement.output
            try:
                while True:
                    if sock.poll(WATCH_INTERVAL_MS):
                        msg = decoder.decode(sock.recv(copy=False).buffer)
                        if isinstance(msg, EngineCoreOutputs):
                            on_message(self, msg)
                        continue
                    if not placement.alive():
                        while sock.poll(0):  # what it sent before it went
                            msg = decoder.decode(sock.recv())
                            if isinstance(msg, EngineCoreOutputs):
                                on_message(self, msg)
                        if not stopping():
                            on_gone(self, placement, placement.exit_description())
                        return
            except (zmq.ZMQError, RuntimeError):  # the sockets closed at shutdown, or the loop did
                return

        self._receiver = threading.Thread(target=receive, name=f"splitserve-core-receiver-{self.index}", daemon=True)
        self._receiver.start()

    def join_receiver(self, timeout: float) -> None:
        if self._receiver is not None:
            self._receiver.join(timeout)

    def queued_with(self, num_new: int, max_running: int) -> int:
        """Sequences that will wait for a place in this core's running batch once `num_new` more
        arrive: those sent that it has not taken in yet plus those waiting there, less the free
        places of the batch, which its next step fills."""
        s = self.stats
        free = max(0, max_running - s.num_running)
        return max(0, self.num_sent - s.num_received + s.num_waiting + num_new - free)

    def health(self) -> dict:
        pid = self.placement.pid
        return {"engine": self.index, "status": "ok" if self.up else "restarting", "pid": pid,
                "requests_routed": self.num_routed, "requests_in_flight": len(self.requests),
                "running": self.stats.num_running, "waiting": self.stats.num_waiting,
                "kv_cache_usage": round(self.stats.kv_usage, 4), "restarts": self.restarts,
                **({"last_error": self.last_error} if self.last_error else {})}


def total_stats(replicas: list[Replica]) -> SchedulerStats:
    """The server's counters: the replicas' summed (KV usage: their mean)."""
    if len(replicas) == 1:
        return replicas[0].stats
    ss = [r.stats for r in replicas]
    return SchedulerStats(num_running=sum(s.num_running for s in ss), num_waiting=sum(s.num_waiting for s in ss),
                          kv_usage=sum(s.kv_usage for s in ss) / len(ss),
                          prefix_queries=sum(s.prefix_queries for s in ss), prefix_hits=sum(s.prefix_hits for s in ss),
                          num_preemptions=sum(s.num_preemptions for s in ss),
                          num_received=sum(s.num_received for s in ss),
                          num_receiving=sum(s.num_receiving for s in ss), num_held=sum(s.num_held for s in ss),
                          prompt_tokens_computed=sum(s.prompt_tokens_computed for s in ss),
                          spec_num_drafts=sum(s.spec_num_drafts for s in ss),
                          spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in ss),
                          spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in ss),
                          spec_accepted_per_pos=[sum(p) for p in zip(*(s.spec_accepted_per_pos for s in ss))])


def replica_devices(config: EngineConfig, num_gpus: int | None = None) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica's core (None: leave the environment as it is, on CPU or
    with one replica). Raises ValueError when the GPUs cannot hold the replicas."""
    par: ParallelConfig = config.parallel
    dp = par.data_parallel_size
    if dp == 1 or not config.device.startswith("cuda") or par.data_parallel_backend == "ray":
        return [None] * dp  # (Ray gives each replica's actor its GPUs)
    if num_gpus is None:
        import torch
        num_gpus = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(num_gpus)]
    ids = ids[:num_gpus]
    per_replica = par.world_size
    need = dp * per_replica
    slots = len(ids) // per_replica
    util = config.cache.gpu_memory_utilization
    sharing = math.ceil(dp / slots) if slots else 0
    if len(ids) < need and (not slots or sharing * util > 1.0 + 1e-9):
        raise ValueError(
            f"--data-parallel-size {dp} x {per_replica} GPU(s) per replica (tensor x pipeline parallel) needs "
            f"{need} GPUs; {len(ids)} visible. Replicas may share GPUs only when those on one GPU fit together: "
            f"their --gpu-memory-utilization must add up to at most 1 (here {sharing or dp} x {util})")
    return [",".join(ids[(i % slots) * per_replica:(i % slots + 1) * per_replica]) for i in range(dp)]
