"""The core -> rank messages round-trip through one encoding (what every rank decodes), the grammar
bitmask tensor and sampling params included; the rank -> core answers too. No process."""
from __future__ import annotations

import torch

from splitserve.protocol.sched_output import CachedRequestData, GrammarBitmask, NewRequestData, SchedulerOutput
from splitserve.executor.multiproc import Addresses, addresses, describe_exit, local_ranks
from splitserve.protocol.rank_messages import CoreToWorker, RunStep, StepDone, WorkerToCore
from splitserve.protocol.core_messages import Codec
from splitserve.engine.args import EngineArgs
from splitserve.sampling_params import SamplingParams


def test_step_message_round_trip():
    mask = torch.tensor([[-1, 5], [7, 0]], dtype=torch.int32)
    sched = SchedulerOutput(
        step_id=4, num_scheduled_tokens={"b": 3, "a": 1}, total_num_scheduled_tokens=4,
        new_requests=[NewRequestData("b", [1, 2, 3], SamplingParams(temperature=0.5, seed=7), [0, 1])],
        cached_requests=CachedRequestData(["a"], [[9]]), finished_req_ids=["z"],
        grammar=GrammarBitmask(["a", "b"], mask))
    data = Codec(CoreToWorker).encode(RunStep(sched))
    got = Codec(CoreToWorker).decode(data).sched
    assert list(got.num_scheduled_tokens.items()) == [("b", 3), ("a", 1)]  # batch order kept
    assert got.new_requests[0].sampling_params.seed == 7 and got.new_requests[0].block_ids == [0, 1]
    assert got.cached_requests.new_block_ids == [[9]] and got.finished_req_ids == ["z"]
    assert torch.equal(got.grammar.bitmask, mask)
    done = Codec(WorkerToCore).decode(Codec(WorkerToCore).encode(StepDone(2, {"a": 5}, {"a": {5: -0.5, 6: -1.5}}, {"a": 1})))
    assert done == StepDone(2, {"a": 5}, {"a": {5: -0.5, 6: -1.5}}, {"a": 1})


def test_addresses_and_local_ranks(monkeypatch):
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    one = addresses(EngineArgs(tensor_parallel_size=2, master_port=1234), "/tmp/x")
    assert one == Addresses("tcp://127.0.0.1:1234", "ipc:///tmp/x/steps", "ipc:///tmp/x/results",
                            "ipc:///tmp/x/steps", "ipc:///tmp/x/results")
    two = EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=1,
                     master_addr="127.0.0.1", master_port=2000)
    a = addresses(two, None)
    assert (a.init_method, a.step, a.result, a.step_bind) == (
        "tcp://127.0.0.1:2000", "tcp://127.0.0.1:2001", "tcp://127.0.0.1:2002", "tcp://127.0.0.1:2001")
    assert local_ranks(two) == [2, 3]  # node 1 holds the second pipeline stage's tensor ranks
    assert describe_exit(1, -9) == "rank 1 was killed by SIGKILL (the kernel's out-of-memory killer?)"
    assert describe_exit(0, 3) == "rank 0 exited with code 3"
