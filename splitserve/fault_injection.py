"""Test-only faults in the model step, to prove that a failing step fails its requests and nothing else.

Off unless the environment variable SPLITSERVE_INJECT_STEP_FAULTS is set when the engine starts; it is
read once there, and only then is the runner's `execute` wrapped. With the variable unset the hot
path is the runner's own method, untouched: the hook costs nothing.

The value is comma-separated `key=value` pairs:
- `every=N`  every N-th model step raises (N >= 1): a transient fault, the engine recovers;
- `from=N`   every model step from the N-th on raises: a lost device, the engine cannot recover
             (after a few consecutive failed steps it declares itself dead, see LLMEngine.step).
Steps are counted from 1 over the engine's lifetime.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV_VAR = "SPLITSERVE_INJECT_STEP_FAULTS"


class InjectedFault(RuntimeError):
    """The error an injected fault raises (a stand-in for a kernel or device failure)."""


def parse_spec(spec: str) -> tuple[int | None, int | None]:
    """`every=N,from=M` -> (N, M); raises ValueError with the offending part."""
    every = start = None
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        if key not in ("every", "from") or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{ENV_VAR}: expected every=N or from=N with N >= 1, got {part!r}")
        if key == "every":
            every = int(value)
        else:
            start = int(value)
    if every is None and start is None:
        raise ValueError(f"{ENV_VAR}: no fault given in {spec!r}")
    return every, start


def install_step_faults(runner, spec: str | None = None) -> bool:
    """Wraps runner.launch (the start of every model step) with the faults of `spec` (default: the environment variable).
    Returns whether faults are active."""
    spec = os.environ.get(ENV_VAR) if spec is None else spec
    if not spec:
        return False
    every, start = parse_spec(spec)
    launch = runner.launch
    count = 0

    def faulty_launch(sched, *args):
        nonlocal count
        count += 1
        if (every is not None and count % every == 0) or (start is not None and count >= start):
            raise InjectedFault(f"injected fault in model step {count}")
        return launch(sched, *args)

    runner.launch = faulty_launch
    logger.warning("fault injection is on (%s=%s): model steps will fail on purpose", ENV_VAR, spec)
    return True


# -- faults of one worker process (world size > 1) ----------------------------------------------------
RANK_ENV_VAR = "SPLITSERVE_INJECT_RANK_FAULT"
RANK_FAULT_KINDS = ("exit", "hang", "raise", "startup_oom")


def parse_rank_fault(spec: str) -> tuple[int, int, str]:
    """`rank=R,step=N,kind=K` -> (R, N, K): worker rank R, at its N-th step (from 1), exits at once
    (`exit`: a process that dies), stops answering (`hang`) or raises (`raise`); `startup_oom` raises
    an out-of-memory error while rank R starts (step is then ignored)."""
    fields = dict(part.strip().partition("=")[::2] for part in spec.split(",") if part.strip())
    try:
        rank, step, kind = int(fields["rank"]), int(fields.get("step", "1")), fields["kind"]
    except (KeyError, ValueError):
        raise ValueError(f"{RANK_ENV_VAR}: expected rank=R,step=N,kind=K, got {spec!r}") from None
    if kind not in RANK_FAULT_KINDS or rank < 0 or step < 1:
        raise ValueError(f"{RANK_ENV_VAR}: kind must be one of {', '.join(RANK_FAULT_KINDS)}, rank >= 0, "
                         f"step >= 1; got {spec!r}")
    return rank, step, kind


def rank_fault(rank: int) -> tuple[int, str] | None:
    """(step, kind) of the fault this rank is asked to inject, or None (the normal case)."""
    spec = os.environ.get(RANK_ENV_VAR)
    if not spec:
        return None
    fault_rank, step, kind = parse_rank_fault(spec)
    if fault_rank != rank:
        return None
    logger.warning("fault injection is on (%s=%s): rank %d will fail on purpose", RANK_ENV_VAR, spec, rank)
    return step, kind
