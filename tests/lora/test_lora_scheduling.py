"""The scheduler with LoRA (lora/manager.py): adapters load off the step loop while other requests
run, a step never holds more adapters than slots, slots are evicted only when no running request holds
them, and the step message carries each slot load once."""
import json
import threading

import pytest
import torch
from safetensors.torch import save_file

from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.scheduler import Scheduler
from splitserve.lora.adapter import LoRATargets
from splitserve.lora.manager import LoRAManager
from splitserve.protocol.lora import LoRARequest
from splitserve.core.request import Request, RequestStatus
from splitserve.sampling_params import SamplingParams

TARGETS = LoRATargets(1, {"q": (8, 8), "k": (8, 4), "v": (8, 4), "o": (8, 8), "gate": (8, 16), "up": (8, 16),
                          "down": (16, 8)})


def write_adapter(path, seed):
    g = torch.Generator().manual_seed(seed)
    path.mkdir()
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8, generator=g),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, 4, generator=g)},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    return str(path)


@pytest.fixture
def loras(tmp_path):
    return [LoRARequest(f"a{i}", i + 1, write_adapter(tmp_path / f"a{i}", i)) for i in range(3)]


def make(max_loras=2):
    lora = LoRAManager(TARGETS, max_loras, 8, 3)
    sched = Scheduler(SchedulerConfig(10, 1000), KVCacheManager(100, 4, False), lora=lora)
    return sched, lora


def req(rid, lora=None):
    return Request(rid, list(range(10, 18)), SamplingParams(max_tokens=50), eos_token_ids=(2,),
                   max_total_tokens=1000, lora_request=lora)


def settle(lora, loras):
    for lr in loras:
        while not lora.is_loaded(lr):
            lora.wait_for_loads(1.0)


def test_a_loading_adapter_does_not_block_others(loras):
    sched, lora = make()
    gate = threading.Event()
    real_load = lora._load
    lora._load = lambda lr: (gate.wait(10), real_load(lr))[1]
    sched.add_request(req("with-adapter", loras[0]))
    sched.add_request(req("base"))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["base"] and out.lora_loads == []
    assert [r.request_id for r in sched.waiting] == ["with-adapter"]  # kept its place
    gate.set()
    settle(lora, loras[:1])
    out = sched.schedule()
    assert "with-adapter" in out.num_scheduled_tokens
    assert [(x.slot, x.lora_int_id) for x in out.lora_loads] == [(0, 1)]
    assert out.new_requests[0].lora_id == 1


def test_slots_bound_the_adapters_of_a_step_and_evict_only_unheld_ones(loras):
    sched, lora = make(max_loras=2)
    settle(lora, loras)
    for i, lr in enumerate([loras[0], loras[1], loras[2], None, loras[0]]):
        sched.add_request(req(f"r{i}", lr))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1", "r3", "r4"}  # r2's adapter has no free slot
    assert sorted((x.slot, x.lora_int_id) for x in out.lora_loads) == [(0, 1), (1, 2)]
    assert lora.pins[1] == 2 and lora.pins[2] == 1
    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)  # adapter 2 is no longer held
    out = sched.schedule()
    assert "r2" in out.num_scheduled_tokens
    assert [(x.slot, x.lora_int_id) for x in out.lora_loads] == [(1, 3)]  # evicts 2, not the held 1
    assert lora.slots == [1, 3]
    sched.finish_requests(["r0", "r2", "r3", "r4"], RequestStatus.FINISHED_ABORTED)
    assert all(n == 0 for n in lora.pins.values())
    out = sched.schedule()
    assert out.lora_loads == []


def test_preemption_releases_the_slot(loras):
    sched, lora = make(max_loras=1)
    settle(lora, loras)
    r = req("r", loras[0])
    sched.add_request(r)
    sched.schedule()
    assert lora.pins[1] == 1
    sched.running.remove(r)
    sched._preempt(r)
    assert lora.pins[1] == 0 and not r.lora_pinned
    sched.add_request(req("s", loras[1]))
    out = sched.schedule()  # r (first in the queue) takes the slot again; s waits for it
    assert list(out.num_scheduled_tokens) == ["r"]
