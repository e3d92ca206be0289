"""How a child process of the engine (the engine core, a worker rank) follows its parent's death."""
from __future__ import annotations

import ctypes
import os
import signal


def die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent dies (no orphan holds a GPU).
    Elsewhere nothing happens; callers keep their own check of the parent pid."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def flush_and_exit(ctx, code: int) -> None:
    """Closing a socket only hands its queue to ZeroMQ's I/O thread; terminating the context waits
    (up to the linger) until the last message - often why this process fails - has left."""
    ctx.destroy(linger=2000)
    os._exit(code)  # skip interpreter teardown (CUDA, process groups, compiled graphs): nothing is left
