"""Executors run the model for the engine core (core/executor.py is their contract): in the core's own
process with world size 1, else one worker process per rank (local processes, or Ray actors with
--distributed-executor-backend ray). `build_executor` picks one."""
from __future__ import annotations

from splitserve.config import EngineConfig


def build_executor(config: EngineConfig):
    """The executor for `config` (the model is loaded, the KV cache allocated and the fast path
    captured by the time it returns)."""
    if config.world_size > 1:
        from splitserve.executor.multiproc import MultiprocExecutor
        if config.parallel.distributed_executor_backend == "ray":  # Ray is imported on this path only
            from splitserve.executor.ray_ranks import RayRanks
            return MultiprocExecutor(config, RayRanks(config))
        return MultiprocExecutor(config)
    from splitserve.executor.in_process import InProcessExecutor
    return InProcessExecutor(config)


def build_engine_core(config: EngineConfig):
    """An EngineCore stepping the executor built for `config`."""
    from splitserve.core.engine_core import EngineCore
    return EngineCore(config, build_executor(config))
