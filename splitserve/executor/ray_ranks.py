"""The ranks as Ray actors (--distributed-executor-backend ray): Ray places them over its cluster's nodes
and owns their environment and lifetime; the tensors still move over torch.distributed (NCCL on CUDA,
gloo on CPU) and the step messages over the executor's ZeroMQ sockets, as with local processes.

`RayRanks` is the executor's other kind of ranks (multiproc.py's `LocalRanks` is the first): the
engine core joins the cluster (--ray-address, else $RAY_ADDRESS, else the cluster last started on this
host, else a new local one), reserves one bundle per rank in a placement group (CPU, the GPU on CUDA,
--ray-bundle-resource; --ray-placement-strategy, PACK by default: a node is filled before the next
one is used), starts one `RankActor` per bundle and runs `rank_worker.rank_loop` in each, the same loop
as a worker process. Ranks are numbered node by node (the core's node first) so that tensor-parallel
groups, which are consecutive ranks, stay on one node where they fit. The sockets are tcp:// on the
core's node address, torch.distributed meets at rank 0's node.

Lifetime: each actor's `run` call is an ObjectRef that completes when its loop ends or its actor dies
(its node died, its raylet was killed, the process was killed): `dead()` reports both like a dead
process, so the executor ends the engine as for a lost local rank. The actors belong to the core's
process (not detached): Ray kills them when it goes; `stop` kills them, frees the placement group and
leaves the cluster (stopping it when this process started it).

Ray is imported only here, and only when this backend is asked for: the single-machine path never
imports it (tests/executor/test_ray_optional.py).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from splitserve.config import EngineConfig
from splitserve.executor.multiproc import Addresses

logger = logging.getLogger(__name__)

# Environment variables the ranks get from the core's process (Ray starts actors with their node's
# environment, not ours): splitserve's own switches (fault injection in tests) and the libraries'.
_PASSED_ENV_PREFIXES = ("SPLITSERVE_", "NCCL_", "GLOO_", "TORCH_NCCL_")
# How often a placement that is still waiting says so.
_PLACEMENT_LOG_S = 10.0
# How long a rank's failure waits for Ray to report a peer's death (its likely cause).
_CAUSE_WAIT_S = 2.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'splitserve[ray]'") from None
    return ray


def connect(address: str | None) -> bool:
    """Joins the Ray cluster at `address` (None: $RAY_ADDRESS, else the one last started on this host,
    else a new local one) unless this process is already connected (a Ray actor, a test). True when this
    call connected, so the caller disconnects when it is done."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    # ray.init makes SIGTERM raise SystemExit in the main thread; this process keeps its own handler
    # (the engine core's exits at once; the cluster it started dies with it, by Ray's fate sharing).
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
    if main and handler is not None:
        signal.signal(signal.SIGTERM, handler)
    return True


def free_ports(host: str, n: int) -> list[int]:
    """n distinct free ports of host (all held open while they are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def passed_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV_PREFIXES)}


class RankActor:
    """One rank in a Ray actor (wrapped by ray.remote at start-up: Ray is imported lazily)."""

    def where(self) -> tuple[str, str, int]:
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def gpu_ids(self) -> list[str]:
        import ray
        return [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        import ray
        return free_ports(ray.util.get_node_ip_address(), 1)[0]

    def run(self, config: EngineConfig, rank: int, local_rank: int, init_method: str, step_addr: str,
            result_addr: str, log_level: int, visible_devices: str | None = None) -> int:
        from splitserve.process_lifetime import exit_when_orphaned
        exit_when_orphaned()  # a raylet killed alone leaves its workers running
        if visible_devices is not None:  # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        import zmq

        from splitserve.executor.rank_worker import rank_loop
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s")
        ctx = zmq.Context()
        try:
            return rank_loop(ctx, config, rank, local_rank, init_method, step_addr, result_addr, parent_pid=None)
        finally:
            ctx.destroy(linger=2000)  # the last message (often why it stopped) leaves before we return


def settled_error(ray, actor, exc: BaseException, wait_s: float = 5.0) -> BaseException:
    """Ray first reports an actor whose connection broke as unavailable ("may come back"); its verdict
    (died, and why: "its node has died") follows once the cluster has checked. Asks the actor again
    until the verdict comes, up to wait_s; else the first error."""
    unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
    deadline = time.monotonic() + wait_s
    while isinstance(exc, unavailable) and actor is not None and time.monotonic() < deadline:
        try:
            ray.get(actor.where.remote(), timeout=max(0.1, deadline - time.monotonic()))
            break  # it answers after all: keep the first error
        except ray.exceptions.RayActorError as later:
            if not isinstance(later, unavailable):
                return later
        except Exception:
            break
        time.sleep(0.2)
    return exc


def describe_actor_error(what: str, exc: BaseException, ip: str | None) -> str:
    """One line for a dead actor: Ray's reason ("its node has died", ...) where it gives one."""
    text = str(exc)
    where = f" on {ip}" if ip else ""
    reason = next((line.strip() for line in text.splitlines() if "because" in line), "")
    if not reason:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        reason = lines[0] if lines else type(exc).__name__
    return f"{what} (Ray actor{where}) died: {reason}"


class RayRanks:
    """The tp*pp ranks as Ray actors in one placement group (see the module's docstring)."""

    def __init__(self, config: EngineConfig):
        par = config.parallel
        self.config = config
        self.world = par.world_size
        self.actors: list = []      # by rank
        self.where: list = []       # (node id, ip, pid) by rank
        self.refs: dict[int, object] = {}
        self._ended: dict[int, tuple[bool, str]] = {}  # rank -> (its actor died, why), once seen
        self._waited = False
        self.pg = None
        self._connected = connect(par.ray_address)
        self._ray = import_ray()
        try:
            self._place()
        except BaseException:
            self.stop(0)
            raise

    def _bundle(self) -> dict[str, float]:
        par = self.config.parallel
        bundle = {"CPU": 1.0}
        if self.config.device.startswith("cuda"):
            bundle["GPU"] = 1.0
        if par.ray_bundle_resource is not None:
            name, amount = par.ray_bundle_resource
            bundle[name] = float(amount)
        return bundle

    def _place(self) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        par = self.config.parallel
        bundle = self._bundle()
        self.pg = placement_group([dict(bundle) for _ in range(self.world)], strategy=par.ray_placement_strategy)
        self._wait_placed(bundle)
        env = passed_env()
        remote = ray.remote(RankActor)
        resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actors = [remote.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=resources,
                                 max_restarts=0, runtime_env={"env_vars": env} if env else None,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     self.pg, placement_group_bundle_index=i)).remote()
                  for i in range(self.world)]
        self.actors = actors  # (stop kills them should the next lines fail)
        where = ray.get([a.where.remote() for a in actors], timeout=par.distributed_timeout_s)
        # Rank order: the core's node first, then node by node.
        own = ray.get_runtime_context().get_node_id()
        order = sorted(range(self.world), key=lambda i: (where[i][0] != own, where[i][1], where[i][0], i))
        self.actors = [actors[i] for i in order]
        self.where = [where[i] for i in order]
        nodes = {w[0]: w[1] for w in self.where}
        self.placement = f"{len(nodes)} Ray node(s) at {', '.join(sorted(set(nodes.values())))}"
        for rank, (node_id, ip, pid) in enumerate(self.where):
            logger.info("rank %d: Ray actor pid %d on node %s (%s)", rank, pid, ip, node_id[:12])

    def _wait_placed(self, bundle: dict[str, float]) -> None:
        ray = self._ray
        par = self.config.parallel
        ready = self.pg.ready()
        deadline = time.monotonic() + par.distributed_timeout_s
        while True:
            left = deadline - time.monotonic()
            done, _ = ray.wait([ready], timeout=max(0.0, min(_PLACEMENT_LOG_S, left)))
            if done:
                ray.get(ready)
                return
            what = (f"{self.world} bundles of {bundle} (strategy {par.ray_placement_strategy}); "
                    f"the cluster has {ray.available_resources()} free of {ray.cluster_resources()}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"Ray could not place the ranks within distributed_timeout_s="
                                   f"{par.distributed_timeout_s:g} s: {what}")
            logger.warning("waiting for Ray to place %s", what)

    # -- the executor's questions ------------------------------------------------------------------
    def addresses(self, ipc_dir: str) -> Addresses:
        """tcp:// on this node's address (the ranks may be on other nodes); torch.distributed meets at
        a free port of rank 0's node."""
        ray = self._ray
        ip = ray.util.get_node_ip_address()
        step_port, result_port = free_ports(ip, 2)
        master_ip = self.where[0][1]
        master_port = ray.get(self.actors[0].free_port.remote(), timeout=self.config.parallel.distributed_timeout_s)
        step, result = f"tcp://{ip}:{step_port}", f"tcp://{ip}:{result_port}"
        return Addresses(f"tcp://{master_ip}:{master_port}", step, result, step, result)

    def start(self, addrs: Addresses) -> None:
        level = logging.getLogger().level
        devices = self._node_devices()
        for rank, actor in enumerate(self.actors):
            visible, local_rank = devices[rank]
            self.refs[rank] = actor.run.remote(self.config, rank, local_rank, addrs.init_method, addrs.step,
                                               addrs.result, level, visible)

    def _node_devices(self) -> list[tuple[str | None, int]]:
        """(CUDA_VISIBLE_DEVICES, local rank) by rank. Ray shows each actor only its own GPU; NCCL finds
        the fast paths between a node's GPUs (P2P, NVLink) only when each rank sees them all, so every
        rank of a node sees the node's GPUs of this engine and takes its own by index. (None, 0) on CPU."""
        if not self.config.device.startswith("cuda"):
            return [(None, 0)] * self.world
        ray = self._ray
        timeout = self.config.parallel.distributed_timeout_s
        ids = ray.get([a.gpu_ids.remote() for a in self.actors], timeout=timeout)
        by_node: dict[str, list[str]] = {}
        for (node, _, _), own in zip(self.where, ids):
            by_node.setdefault(node, []).extend(own)
        out = []
        for (node, _, _), own in zip(self.where, ids):
            gpus = sorted(set(by_node[node]), key=lambda g: (len(g), g))
            out.append((",".join(gpus), gpus.index(own[0])))
        return out

    def dead(self) -> list[str]:
        """Why each rank whose loop has ended, or whose actor died, is gone (none: all running); the
        actors' deaths first. A loop that ended with an error is often the echo of a peer whose node
        died (its collective broke), and Ray reports the death a moment later: the first time a loop
        ends so, the others get that moment to show the cause."""
        fresh = self._poll(0)
        if fresh and not self._waited and not any(self._ended[r][0] for r in fresh):
            self._waited = True
            self._poll(_CAUSE_WAIT_S)
        return [why for _, _, why in sorted((not died, rank, why) for rank, (died, why) in self._ended.items())]

    def _poll(self, timeout: float) -> list[int]:
        """Records the ranks that ended (waiting up to timeout for the first one); returns them."""
        ray = self._ray
        pending = {ref: rank for rank, ref in self.refs.items() if rank not in self._ended}
        if not pending:
            return []
        done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        if done:  # and whatever else has ended by now
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in done:
            self._ended[pending[ref]] = self._why(pending[ref], ref)
        return [pending[ref] for ref in done]

    def _why(self, rank: int, ref) -> tuple[bool, str]:
        """(whether the actor died, why the rank is gone)."""
        ray = self._ray
        ip = self.where[rank][1] if rank < len(self.where) else None
        try:
            code = ray.get(ref, timeout=5)
        except ray.exceptions.RayActorError as e:
            return True, describe_actor_error(f"rank {rank}", settled_error(ray, self.actors[rank], e), ip)
        except Exception as e:  # the loop raised (it reports its own failures, so this is rare)
            first = str(e).splitlines()[0] if str(e) else ""
            return False, f"rank {rank} (Ray actor on {ip}) failed: {type(e).__name__}: {first}"
        return False, f"rank {rank} (Ray actor on {ip}) exited with code {code}"

    def stop(self, timeout: float = 5.0) -> None:
        """Waits up to timeout for the loops told to stop, then kills every actor, frees the placement
        group and leaves the cluster (idempotent)."""
        ray = self._ray if hasattr(self, "_ray") else None
        if ray is None or not ray.is_initialized():
            return
        refs = [ref for rank, ref in self.refs.items() if rank not in self._ended]
        if refs and timeout > 0:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=timeout)
            except Exception:  # a cluster already gone: nothing to wait for
                pass
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors, self.refs = [], {}
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        if self._connected:
            self._connected = False
            ray.shutdown()
