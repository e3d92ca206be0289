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


def exit_when_orphaned(interval_s: float = 1.0) -> None:
    """Starts a daemon thread that ends this process (status 1) once its parent has changed: for a
    Ray actor, whose parent is its node's raylet. Ray reports such a node dead, but the worker process
    itself may run on with its sockets (and a GPU) until something ends it. A polling thread rather than
    PR_SET_PDEATHSIG: that signal follows the parent's thread that forked us, which need not live on."""
    import threading
    import time
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)
    threading.Thread(target=watch, name="splitserve-orphan-watch", daemon=True).start()
