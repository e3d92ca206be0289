"""One engine core in a Ray actor (--data-parallel-backend ray): the data-parallel front places each
replica's core on a Ray node and watches it as it watches a core process.

The front binds its two sockets on tcp:// addresses the core's node can reach and hands them over with
the core's entry point (`engine.core_loop.core_process_main`: executor/ sits below engine/, so the
entry is passed in, not imported). The actor runs it with parent_pid None: no parent to follow; Ray
owns the lifetime instead. The actor belongs to the process that created it (not detached), so Ray
kills it when the front's process dies; a core whose node dies (its raylet killed, the machine gone)
is an actor Ray reports dead, which `alive()` returns as False and `exit_description()` explains, as
a dead process's exit code would. A core that uses Ray for its own ranks owns them (ray_ranks.py):
they go with it.

    host = RayCoreHost(config, "tcp://10.0.0.1:5501", "tcp://10.0.0.1:5502", core_process_main,
                       resources={"node1": 0.01})
    host.start()            # returns at once; the core says CoreReady on the output socket
    host.alive(); host.pid; host.node_ip
    host.kill(); host.join(5)

Ray is imported only when a host starts.
"""
from __future__ import annotations

import logging
from typing import Callable

from splitserve.config import EngineConfig
from splitserve.executor.ray_ranks import connect, describe_actor_error, import_ray, passed_env, settled_error

logger = logging.getLogger(__name__)


class CoreActor:
    """The actor's class (wrapped by ray.remote when a host starts: Ray is imported lazily)."""

    def where(self) -> tuple[str, str, int]:
        import os

        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def run(self, entry: Callable, config: EngineConfig, input_addr: str, output_addr: str, log_level: int) -> int:
        from splitserve.process_lifetime import exit_when_orphaned
        exit_when_orphaned()  # a raylet killed alone leaves its workers running (and the front's sockets open)
        return entry(config, input_addr, output_addr, None, log_level)


class RayCoreHost:
    """An engine core as a Ray actor, with the interface the front uses for a core process.

    entry: `core_process_main(config, input_addr, output_addr, parent_pid, log_level)`.
    Placement (all optional): node_id (a Ray node id: hard node affinity), resources (custom resources
    the actor takes, e.g. {"node1": 0.01} for a node started with `--resources '{"node1": 1}'`), or
    placement_group + bundle_index (a bundle reserved by the caller). num_cpus: the actor's CPUs;
    num_gpus: its GPUs (default: on CUDA, the core's world size when its ranks are local processes,
    else 0: Ray ranks take their own). ray_address: the cluster to join when this process has not
    joined one yet (None: $RAY_ADDRESS, else the latest local cluster, else a new local one)."""

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str, entry: Callable, *,
                 node_id: str | None = None, resources: dict[str, float] | None = None, placement_group=None,
                 bundle_index: int = -1, num_cpus: float = 1.0, num_gpus: float | None = None,
                 ray_address: str | None = None, log_level: int | None = None, name: str = "engine core"):
        for addr in (input_addr, output_addr):
            if not addr.startswith("tcp://"):
                raise ValueError(f"a Ray-hosted engine core reaches the front over tcp://, got {addr!r}")
        if node_id is not None and placement_group is not None:
            raise ValueError("give node_id or placement_group, not both")
        self.config, self.input_addr, self.output_addr, self.entry = config, input_addr, output_addr, entry
        self.node_id, self.resources = node_id, dict(resources or {})
        self.placement_group, self.bundle_index = placement_group, bundle_index
        if num_gpus is None:
            local_ranks = config.parallel.distributed_executor_backend != "ray"
            num_gpus = (config.world_size if local_ranks else 0) if config.device.startswith("cuda") else 0
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.ray_address = ray_address if ray_address is not None else config.parallel.ray_address
        self.log_level = logging.getLogger().level if log_level is None else log_level
        self.name = name
        self._ray = None
        self._actor = None
        self._ref = None      # the run call: completes when the loop returns or the actor dies
        self._where = None    # (node id, ip, pid), once the actor has answered
        self._where_ref = None
        self._ended: str | None = None

    def start(self) -> None:
        """Creates the actor and starts the core in it; returns at once (the core sends CoreReady, or
        its start-up error, on the output socket)."""
        connect(self.ray_address)
        ray = self._ray = import_ray()
        opts = dict(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0, max_concurrency=1)
        if self.resources:
            opts["resources"] = self.resources
        if self.node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_id, soft=False)
        elif self.placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=self.bundle_index)
        env = passed_env()
        if env:
            opts["runtime_env"] = {"env_vars": env}
        self._actor = ray.remote(CoreActor).options(**opts).remote()
        self._where_ref = self._actor.where.remote()  # answered before run starts (one call at a time)
        self._ref = self._actor.run.remote(self.entry, self.config, self.input_addr, self.output_addr, self.log_level)

    def _located(self, timeout: float = 0) -> tuple[str, str, int] | None:
        if self._where is None and self._where_ref is not None:
            done, _ = self._ray.wait([self._where_ref], timeout=timeout)
            if done:
                try:
                    self._where = self._ray.get(self._where_ref)
                except Exception:  # the actor died before it answered
                    self._where_ref = None
        return self._where

    @property
    def pid(self) -> int | None:
        """The core's process id on its node (None until the actor has started, or if it never did)."""
        where = self._located()
        return None if where is None else where[2]

    @property
    def node_ip(self) -> str | None:
        where = self._located()
        return None if where is None else where[1]

    @property
    def node(self) -> str | None:
        """The Ray node id the core runs on."""
        where = self._located()
        return None if where is None else where[0]

    def alive(self) -> bool:
        """True from start() until the core's loop has returned or its actor has died (a core still
        waiting for Ray to place it counts as alive: the front's ready timeout bounds that wait)."""
        if self._ref is None:
            return False
        if self._ended is not None:
            return False
        done, _ = self._ray.wait([self._ref], timeout=0)
        if not done:
            return True
        self._ended = self._why()
        return False

    def _why(self) -> str:
        ray = self._ray
        where = self._located()
        ip = where[1] if where else None
        try:
            code = ray.get(self._ref, timeout=5)
        except ray.exceptions.RayActorError as e:
            return describe_actor_error(f"the {self.name}", settled_error(ray, self._actor, e), ip)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            return f"the {self.name} (Ray actor on {ip}) failed: {type(e).__name__}: {first}"
        return f"the {self.name} (Ray actor on {ip}) exited with code {code}"

    def exit_description(self) -> str:
        if self._ref is None:
            return f"the {self.name} was not started"
        if self.alive():
            return f"the {self.name} is running"
        return self._ended

    def kill(self) -> None:
        """Ends the actor now (its process with it; the core's own Ray ranks go with their owner)."""
        if self._actor is not None:
            try:
                self._ray.kill(self._actor, no_restart=True)
            except Exception:  # already gone, or the cluster is
                pass

    def join(self, timeout: float) -> None:
        """Waits up to timeout for the core to stop (after the front's Shutdown), then kills the actor:
        a returned loop leaves an idle actor holding the model's memory."""
        if self._ref is None:
            return
        try:
            self._ray.wait([self._ref], timeout=timeout)
        except Exception:
            pass
        self.alive()  # records how it ended before the kill makes every ending look alike
        self.kill()
