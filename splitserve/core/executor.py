"""What the engine core needs of whatever runs the model: the contract of the executors in executor/
(in this process, or one worker process per rank). The core is handed one; it never builds one."""
from __future__ import annotations

from typing import Any, Protocol


class Executor(Protocol):
    num_blocks: int  # KV blocks every rank has allocated
    kv_free_window: int | None  # tokens after which a request's blocks can go (None: never, some layer sees all)
    lora: Any  # the LoRAManager with --enable-lora, else None
    # The KV pool's tensors when they live in this process (world size 1: a KV connector reads and
    # writes them); the rank executors have none here.
    kv_caches: Any

    def launch(self, sched, inflight=None) -> Any:
        """Starts a step (the scheduler's plain-data output); returns the step in flight."""

    def sample(self, launched, bitmask) -> None:
        """Enqueues the sampler of a step launched before its grammar masks were filled."""

    def collect(self, launched) -> Any:
        """Waits for a launched step's tokens (a worker.model_runner.StepResult)."""

    def update_states(self, sched) -> None:
        """Applies a step message that runs nothing (removals only)."""

    def check_alive(self) -> None:
        """Raises protocol.rank_messages.RanksLostError if a process of the executor is gone."""

    def shutdown(self) -> None:
        """Stops what the executor started."""
