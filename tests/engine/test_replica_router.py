"""The data-parallel front's choice of replica (engine/replica_router.py) and its GPU assignment
(engine/replicas.replica_devices): exact, on the CPU, no engine."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from splitserve.config import ParallelConfig
from splitserve.protocol.block_hash import hash_block
from splitserve.engine.replica_router import ReplicaRouter
from splitserve.engine.replicas import replica_devices

BS = 16


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def test_block_hashes_are_the_prefix_caches_chained_hashes():
    router = ReplicaRouter(2, BS, max_running=8)
    ids = tokens(0, 3 * BS + 5)
    expected, parent = [], None
    for i in range(3):  # only full blocks; the partial tail is not hashed
        parent = hash_block(parent, tuple(ids[i * BS:(i + 1) * BS]), ())
        expected.append(parent)
    assert router.block_hashes(ids) == expected
    assert router.block_hashes(ids[:BS - 1]) == []
    # an adapter's blocks are its own (the cache keys them by adapter too)
    assert router.block_hashes(ids, lora_id=3)[0] == hash_block(None, tuple(ids[:BS]), (3,))
    assert router.block_hashes(ids, lora_id=3)[0] != expected[0]


def test_distinct_prefixes_alternate_when_idle_and_balance_under_load():
    router = ReplicaRouter(2, BS, max_running=8)
    idle = [router.choose(router.block_hashes(tokens(i, 40)), [0, 0]) for i in range(200)]
    assert idle.count(0) == 100  # ties go round the replicas
    loads = [0.0, 0.0]
    for i in range(200):  # nothing finishes: each choice adds one sequence of load
        r = router.choose(router.block_hashes(tokens(1000 + i, 40)), loads)
        loads[r] += 1
    assert loads == [100, 100]


def test_a_known_prefix_goes_where_it_went_before():
    router = ReplicaRouter(3, BS, max_running=8)
    system = [tokens(50 + k, 4 * BS) for k in range(6)]
    first = {k: router.choose(router.block_hashes(system[k] + tokens(k, 7)), [0, 0, 0]) for k in range(6)}
    assert sorted(first.values()) == [0, 0, 1, 1, 2, 2]
    for j in range(30):
        for k in range(6):
            # other replicas a little less loaded than the owner: affinity still wins
            loads = [3.0, 3.0, 3.0]
            loads[first[k]] = 5.0
            assert router.choose(router.block_hashes(system[k] + tokens(100 * j + k, 9)), loads) == first[k]
    # the longest known prefix decides: a prompt sharing only the first block of system[0] but all
    # of a later-routed prompt's blocks goes to the later one
    longer = system[0][:BS] + tokens(7, 3 * BS)
    r = router.choose(router.block_hashes(longer), [0, 9, 9])
    assert r == 0 or first[0] == 0
    other = (first[0] + 1) % 3
    router._record(router.block_hashes(longer), other)
    loads = [0.0, 0.0, 0.0]
    assert router.choose(router.block_hashes(longer + tokens(8, BS)), loads) == other
    assert router.choose(router.block_hashes(system[0][:BS] + tokens(9, 2 * BS)), loads) == other


def test_affinity_yields_to_an_overloaded_replica_and_skips_a_restarting_one():
    router = ReplicaRouter(2, BS, max_running=8)
    sys_prompt = tokens(1, 3 * BS)
    owner = router.choose(router.block_hashes(sys_prompt), [0, 0])
    other = 1 - owner
    busy = [0.0, 0.0]
    busy[owner] = 8.0       # a full batch ...
    busy[other] = 6.5       # ... but the other has less than a quarter batch (2) less: stay
    assert router.choose(router.block_hashes(sys_prompt + [5]), busy) == owner
    busy[other] = 5.0       # 3 less: the owner is overloaded, the request goes to the other
    assert router.choose(router.block_hashes(sys_prompt + [6]), busy) == other
    # ... which now holds the prefix too and is its owner from here on
    assert router.choose(router.block_hashes(sys_prompt + [7]), [0, 0]) == other
    down = [None, None]
    down[other] = None
    down[1 - other] = 50.0
    assert router.choose(router.block_hashes(sys_prompt), down) == 1 - other
    with pytest.raises(RuntimeError, match="no engine replica"):
        router.choose([], [None, None])


def test_forget_drops_a_restarted_replicas_prefixes_and_the_table_is_bounded():
    router = ReplicaRouter(2, BS, max_running=8, max_entries=10)
    p = tokens(3, 4 * BS)
    owner = router.choose(router.block_hashes(p), [0, 0])
    router.forget(owner)
    assert all(r != owner for r in router._owner.values())
    for i in range(20):
        router.choose(router.block_hashes(tokens(200 + i, 4 * BS)), [0, 0])
    assert len(router._owner) == 10


def config(dp: int, tp: int = 1, util: float = 0.9, device: str = "cuda"):
    return SimpleNamespace(parallel=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp),
                           device=device, cache=SimpleNamespace(gpu_memory_utilization=util))


def test_replica_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert replica_devices(config(1), num_gpus=8) == [None]
    assert replica_devices(config(2, device="cpu"), num_gpus=0) == [None, None]
    assert replica_devices(config(2, tp=2), num_gpus=4) == ["0,1", "2,3"]
    assert replica_devices(config(4), num_gpus=4) == ["0", "1", "2", "3"]
    # two replicas on one GPU: only when their shares fit together
    assert replica_devices(config(2, util=0.45), num_gpus=1) == ["0", "0"]
    with pytest.raises(ValueError, match=r"needs 2 GPUs; 1 visible.*2 x 0.9"):
        replica_devices(config(2), num_gpus=1)
    with pytest.raises(ValueError, match=r"needs 4 GPUs; 1 visible"):
        replica_devices(config(2, tp=2, util=0.3), num_gpus=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert replica_devices(config(2), num_gpus=2) == ["4", "6"]


def test_parallel_config_checks_the_data_parallel_fields():
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        ParallelConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_backend must be one of mp, ray"):
        ParallelConfig(data_parallel_backend="slurm")
    with pytest.raises(ValueError, match="cannot be combined with --nnodes"):
        ParallelConfig(nnodes=2, data_parallel_size=2)
