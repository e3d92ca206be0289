"""A headless node (--node-rank > 0): starts this host's worker processes and watches them; node 0 runs
the engine core and the API. `splitserve serve --nnodes N --node-rank r --master-addr A --master-port P`
runs this instead of a server when r > 0 (vLLM's `--headless`).

It exits when its workers stop (the core's `Stop`: status 0), when one of them dies (it tells the core
with `RankLost`, stops the others, status 1), when node 0's engine core goes away (its results socket
drops: the workers are stopped, status 1), or on SIGTERM / SIGINT (workers stopped, status 0).
"""
from __future__ import annotations

import logging
import signal
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.executor.multiproc import addresses, check_devices, describe_exit, start_workers, stop_processes
from splitserve.protocol.rank_messages import RankLost, WorkerToCore
from splitserve.config import EngineConfig
from splitserve.protocol.core_messages import Codec

logger = logging.getLogger(__name__)

# How long the ranks may take to act on the core's Stop after its sockets close.
_CORE_GONE_GRACE_S = 5.0


def run_headless(config: EngineConfig) -> int:
    """A node of rank > 0: its ranks only, until node 0's engine core goes away."""
    par = config.parallel
    if par.node_rank == 0:
        raise ValueError("node 0 runs the engine core and the API: start it with `splitserve serve`")
    check_devices(par, config.device)
    addrs = addresses(par, None)
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        logger.info("received %s; stopping this node's ranks", signal.Signals(signum).name)
        stopping = True
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    monitor = push.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    push.connect(addrs.result)
    encode = Codec(WorkerToCore).encode
    procs = start_workers(config, addrs)
    logger.info("node %d of %d: ranks %s started; engine core at %s", par.node_rank, par.nnodes, sorted(procs),
                par.master_addr)
    connected, code, core_gone_at = False, 0, None
    try:
        while not stopping:
            time.sleep(0.2)
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                connected |= event == zmq.EVENT_CONNECTED
                if event == zmq.EVENT_DISCONNECTED and connected and core_gone_at is None:
                    core_gone_at = time.monotonic()  # a core that stops sent Stop first: give it a moment
            if core_gone_at is not None and time.monotonic() - core_gone_at > _CORE_GONE_GRACE_S:
                logger.error("node 0's engine core is gone; stopping this node's ranks")
                return (code := 1)
            exited = {rank: p.exitcode for rank, p in procs.items() if not p.is_alive()}
            failed = {rank: c for rank, c in exited.items() if c != 0}
            if failed:
                rank, c = next(iter(failed.items()))
                why = f"{describe_exit(rank, c)} on node {par.node_rank}"
                logger.error("%s; telling the engine core and stopping this node's ranks", why)
                push.send(encode(RankLost(rank, why)))
                return (code := 1)
            if len(exited) == len(procs):
                logger.info("this node's ranks have stopped")
                return 0
        return 0
    finally:
        stop_processes(list(procs.values()), timeout=0 if code or stopping else 5.0)
        monitor.close(0)
        push.close(linger=2000)
        ctx.term()
