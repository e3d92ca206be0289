"""What crosses between the engine core and its worker processes (world size > 1): plain msgspec data.

Core -> every rank (one encoding, broadcast on a ZeroMQ XPUB socket): `RunStep` (the scheduler's step
message, protocol/sched_output.py, unchanged), `UpdateStates` (a message that runs nothing but removes
requests), `StartKV` (the KV-cache size every rank allocates: the smallest any rank can hold), `Stop`.

Ranks -> core (PUSH/PULL): each rank's `RankBlocks` and `RankReady` at start-up; per step only the
sampling rank answers (`StepDone`: the step's tokens and logprobs by request id); any rank that fails
says so (`RankFailed`), and a headless node's launcher reports a worker process that died (`RankLost`).
"""
from __future__ import annotations

import msgspec

from splitserve.protocol.sched_output import SchedulerOutput


class RanksLostError(RuntimeError):
    """A rank died, failed or hung: the engine cannot go on (the core raises its EngineDeadError)."""


class RunStep(msgspec.Struct, array_like=True, tag=True):
    sched: SchedulerOutput


class UpdateStates(msgspec.Struct, array_like=True, tag=True):
    sched: SchedulerOutput


class StartKV(msgspec.Struct, array_like=True, tag=True):
    num_blocks: int


class Stop(msgspec.Struct, array_like=True, tag=True):
    pass


class RankBlocks(msgspec.Struct, array_like=True, tag=True):
    rank: int
    num_blocks: int


class RankReady(msgspec.Struct, array_like=True, tag=True):
    rank: int


class StepDone(msgspec.Struct, array_like=True, tag=True):
    step_no: int                               # the rank's count of RunStep messages, from 0
    tokens: dict[str, int]
    logprobs: dict[str, dict[int, float]] = {}
    logprob_ranks: dict[str, int] = {}
    # Speculative decoding (worker/model_runner.StepResult's fields of the same names).
    more_tokens: dict[str, list[int]] = {}
    more_logprobs: dict[str, list[dict[int, float]]] = {}
    more_logprob_ranks: dict[str, list[int]] = {}
    draft_token_ids: dict[str, list[int]] = {}


class RankFailed(msgspec.Struct, array_like=True, tag=True):
    rank: int
    error: str
    startup: bool = False


class RankLost(msgspec.Struct, array_like=True, tag=True):
    rank: int
    why: str


CoreToWorker = RunStep | UpdateStates | StartKV | Stop
WorkerToCore = RankBlocks | RankReady | StepDone | RankFailed | RankLost
