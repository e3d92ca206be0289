"""LoRA weights travel in the step message (lora/manager.py -> protocol/lora.py -> lora/worker.py): the
scheduler's message carries each slot assignment once, with the adapter's tensors; through the rank
processes' codec and back they load a worker built with no manager at all (nothing to call into), and
a tensor-parallel rank's wrappers keep their part of them. Aborts and a launch that fails leave the
slots, the pins and the KV pool whole, and the worker's slots as the core's."""
import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.request import Request, RequestStatus
from splitserve.core.scheduler import Scheduler
from splitserve.layers.linear import Linear, MergedLinear
from splitserve.lora.adapter import LoRATargets, load_adapter
from splitserve.lora.layers import LoRALinear, LoRAState, attach_lora
from splitserve.lora.manager import LoRAManager
from splitserve.kernels.lora.lora_add import LoRALayout
from splitserve.lora.worker import LoRAWorker
from splitserve.models.decoder import DecoderForCausalLM
from splitserve.protocol.core_messages import Codec
from splitserve.protocol.lora import LoRARequest
from splitserve.protocol.rank_messages import CoreToWorker, RunStep
from splitserve.sampling_params import SamplingParams

CFG = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=2, vocab_size=64, max_position_embeddings=64)
TARGETS = LoRATargets.from_hf_config(CFG)
R = 8  # --max-lora-rank
# per adapter: (layer, projection) it has, and its rank
MODULES = [[(0, "q"), (0, "v"), (1, "down")], [(0, "k"), (1, "o"), (1, "gate")], [(1, "q"), (1, "up")]]
RANKS = [4, 8, 2]


def write_adapter(path, seed, modules, r):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, proj in modules:
        n_in, n_out = TARGETS.shapes[proj]
        parent = "mlp" if proj in ("gate", "up", "down") else "self_attn"
        name = f"base_model.model.model.layers.{layer}.{parent}.{proj}_proj"
        tensors[f"{name}.lora_A.weight"] = torch.randn(r, n_in, generator=g)
        tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, r, generator=g)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 2 * r}))
    return str(path)


@pytest.fixture
def loras(tmp_path):
    return [LoRARequest(f"a{i}", i + 1, write_adapter(tmp_path / f"a{i}", i, m, r))
            for i, (m, r) in enumerate(zip(MODULES, RANKS))]


def make_core(max_loras=2):
    lora = LoRAManager(TARGETS, max_loras, R, 3)
    kv = KVCacheManager(100, 4, False)
    return Scheduler(SchedulerConfig(10, 1000), kv, lora=lora), lora, kv


def make_worker():
    """The worker's side alone: a model with LoRA attached and no manager (no core to ask)."""
    gen = torch.Generator().manual_seed(0)
    model = DecoderForCausalLM(CFG)
    for p in model.parameters():
        p.data.normal_(0, 0.1, generator=gen)
    return LoRAWorker(attach_lora(model, 2, R, max_tokens=64)), model


def req(rid, lora=None):
    return Request(rid, list(range(10, 18)), SamplingParams(max_tokens=50), eos_token_ids=(2,),
                   max_total_tokens=1000, lora_request=lora)


def settle(lora, loras):
    for lr in loras:
        while not lora.is_loaded(lr):
            lora.wait_for_loads(1.0)


def through_ranks(sched):
    """The message as a rank process gets it: encoded once, decoded on the other side."""
    codec = Codec(CoreToWorker)
    return codec.decode(codec.encode(RunStep(sched))).sched


def assert_slot_holds(model, slot, lr):
    """Every wrapper's slot holds exactly this adapter's A and B (scaled as load_adapter scales them),
    zero-padded to R, and zeros for the projections it has none for."""
    want = load_adapter(lr.lora_int_id, lr.lora_name, lr.lora_path, TARGETS, R).weights
    seen = 0
    for layer in model.layers:
        for w in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            col = 0
            for i, (proj, size) in enumerate(zip(w.projections, w.shard_sizes)):
                a_got, b_got = w.lora_a[slot, i * R:(i + 1) * R], w.lora_b[slot, col:col + size]
                pair = want.get((w.layer_idx, proj))
                if pair is None:
                    assert not a_got.any() and not b_got.any(), (w.layer_idx, proj)
                else:
                    a, b = pair
                    r = a.shape[0]
                    torch.testing.assert_close(a_got[:r], a, rtol=0, atol=0)
                    torch.testing.assert_close(b_got[:, :r], b, rtol=0, atol=0)
                    assert not a_got[r:].any() and not b_got[:, r:].any()
                    seen += 1
                col += size
    assert seen == len(want)


def test_the_step_message_carries_each_slot_load_once_and_the_worker_loads_from_it(loras):
    sched, lora, kv = make_core()
    worker, model = make_worker()
    settle(lora, loras)
    for rid, lr in (("r0", loras[0]), ("r1", loras[1]), ("r2", loras[0]), ("base", None)):
        sched.add_request(req(rid, lr))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1", "r2", "base"}
    # adapter 1 once, though two requests run with it
    assert [(x.slot, x.lora_int_id) for x in out.lora_loads] == [(0, 1), (1, 2)]
    for load, lr in zip(out.lora_loads, loras):
        want = load_adapter(lr.lora_int_id, lr.lora_name, lr.lora_path, TARGETS, R).weights
        assert {(m.layer, m.proj) for m in load.modules} == set(want)
        host = lora.host_adapter(lr.lora_int_id, lr.lora_path).weights
        # in the core's own process the message holds the host copies themselves, not copies of them
        assert all(m.a is host[m.layer, m.proj][0] and m.b is host[m.layer, m.proj][1] for m in load.modules)
    received = through_ranks(out)
    assert all(isinstance(m.a, torch.Tensor) for x in received.lora_loads for m in x.modules)
    worker.apply_loads(received.lora_loads)
    assert worker.slot_of == {1: 0, 2: 1}
    assert_slot_holds(model, 0, loras[0])
    assert_slot_holds(model, 1, loras[1])
    # the rows find their slots; a step whose adapters sit in their slots carries no load
    assert worker.prepare_step(np.array([1, 2, 1, 0]), np.array([8, 8, 8, 8]))
    sched.advance(out)
    assert sched.schedule().lora_loads == []

    # adapter 2 gone from the running batch: adapter 3 takes its slot, in one load
    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(req("r3", loras[2]))
    out = sched.schedule()
    assert [(x.slot, x.lora_int_id) for x in out.lora_loads] == [(1, 3)]
    worker.apply_loads(through_ranks(out).lora_loads)
    assert worker.slot_of == {1: 0, 3: 1}
    assert_slot_holds(model, 1, loras[2])  # nothing of adapter 2 left where adapter 3 has no module
    assert_slot_holds(model, 0, loras[0])

    sched.finish_requests(["r0", "r2", "r3", "base"], RequestStatus.FINISHED_ABORTED)
    assert all(n == 0 for n in lora.pins.values()) and kv.pool.is_whole()
    assert {lid: s for s, lid in enumerate(lora.slots) if lid is not None} == worker.slot_of
    out = sched.schedule()
    assert out.is_empty and out.lora_loads == [] and out.has_removals


def test_loads_of_a_launch_that_failed_go_with_the_next_message(loras):
    """The message never reached the worker: its slot loads are sent again (also in a message that
    runs nothing), or the worker would run the adapter's next request on what the slot held before."""
    sched, lora, kv = make_core(max_loras=1)
    worker, model = make_worker()
    settle(lora, loras)
    sched.add_request(req("r0", loras[0]))
    out = sched.schedule()
    assert [(x.slot, x.lora_int_id) for x in out.lora_loads] == [(0, 1)]
    failed = sched.fail_step(out, RequestStatus.FINISHED_ERROR, launched=False)
    assert [r.request_id for r in failed] == ["r0"]
    assert all(n == 0 for n in lora.pins.values()) and kv.pool.is_whole()
    again = sched.schedule()
    assert again.is_empty and again.has_updates
    assert [(x.slot, x.lora_int_id) for x in again.lora_loads] == [(0, 1)]
    worker.apply_loads(through_ranks(again).lora_loads)
    assert worker.slot_of == {1: 0}
    assert_slot_holds(model, 0, loras[0])
    sched.add_request(req("r1", loras[0]))
    assert sched.schedule().lora_loads == []  # in its slot, on both sides


def test_a_tensor_parallel_rank_keeps_its_part_of_the_whole_adapter():
    """Rank 1 of 2, cut by hand here: column-parallel q/k/v (4 query heads of 8 per rank, 2 KV heads
    replicated over 4 ranks: this rank's KV head is head 0 of 2) keep their rows of B; row-parallel o
    keeps its columns of A (the partial delta joins the all-reduce)."""
    gen = torch.Generator().manual_seed(1)
    hd, hidden = 4, 16
    qkv = MergedLinear(hidden, {"q": 4 * hd, "k": hd, "v": hd})
    qkv.tp_output = {"q": 1, "k": 0, "v": 0}
    o = Linear(4 * hd, hidden)  # this rank's 16 of the 32 input features
    o.tp_input = 1
    state, layout = LoRAState(), LoRALayout(16, 1, "cpu")
    w_qkv = LoRALinear(qkv, ("q", "k", "v"), 3, state, layout, 1, R)
    w_o = LoRALinear(o, ("o",), 3, state, layout, 1, R)
    whole = {(3, "q"): (torch.randn(5, hidden, generator=gen), torch.randn(8 * hd, 5, generator=gen)),
             (3, "k"): (torch.randn(5, hidden, generator=gen), torch.randn(2 * hd, 5, generator=gen)),
             (3, "o"): (torch.randn(5, 8 * hd, generator=gen), torch.randn(hidden, 5, generator=gen)),
             (2, "v"): (torch.randn(5, hidden, generator=gen), torch.randn(2 * hd, 5, generator=gen))}  # another layer
    for w in (w_qkv, w_o):
        w.set_slot(0, whole)
    (aq, bq), (ak, bk), (ao, bo) = whole[3, "q"], whole[3, "k"], whole[3, "o"]
    assert torch.equal(w_qkv.lora_a[0, :5], aq) and torch.equal(w_qkv.lora_a[0, R:R + 5], ak)
    assert torch.equal(w_qkv.lora_b[0, :4 * hd, :5], bq[4 * hd:])           # q rows of query heads 4..7
    assert torch.equal(w_qkv.lora_b[0, 4 * hd:5 * hd, :5], bk[:hd])         # k rows of KV head 0
    assert not w_qkv.lora_b[0, 5 * hd:].any() and not w_qkv.lora_a[0, 2 * R:].any()  # no v for layer 3
    assert torch.equal(w_o.lora_a[0, :5], ao[:, 4 * hd:])                   # o's input features 16..31
    assert torch.equal(w_o.lora_b[0, :, :5], bo)
