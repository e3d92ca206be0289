"""The scheduler and KV manager with encoder-decoder requests, exactly: an encoder runs at admission
(its positions budgeted like prefill tokens, its cross blocks allocated as a second group), the step
message lists it once, preemption frees both groups and runs the encoder again, aborts leave the
pool whole, and decoder blocks are shared only between requests with the same encoder input."""
import random

import pytest

from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.scheduler import Scheduler
from splitserve.core.request import Request, RequestStatus
from splitserve.sampling_params import SamplingParams

BS = 4


def make(num_blocks=100, budget=16, max_seqs=10, caching=False):
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget), kv), kv


def encdec(rid, enc, decoder_prompt=(0,), max_tokens=50, encoder_ids=None):
    ids = list(range(100, 100 + enc)) if encoder_ids is None else encoder_ids
    return Request(rid, list(decoder_prompt), SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,),
                   max_total_tokens=1000, encoder_prompt_ids=ids, num_encoder_tokens=len(ids))


def step(sched, token=7):
    out = sched.schedule()
    sampled = {rid: token for rid, n in out.num_scheduled_tokens.items()
               if sched.requests[rid].num_computed_tokens + n == sched.requests[rid].num_tokens}
    assert sched.advance(out) == len(sampled)
    sched.update(out, sampled)
    return out


def test_encoder_runs_at_admission_within_the_budget():
    sched, kv = make(budget=16)
    a, b = encdec("a", 10), encdec("b", 10)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    # a: 10 encoder positions + its decoder start token; b's 10 do not fit the 5 left
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.total_num_scheduled_tokens == 11
    assert out.encoder_runs == {"a": a.encoder_block_ids}
    assert len(a.encoder_block_ids) == 3 and len(a.block_ids) == 1
    assert not set(a.encoder_block_ids) & set(a.block_ids)
    assert out.new_requests[0].encoder_prompt_ids == list(range(100, 110))
    assert out.new_requests[0].num_encoder_tokens == 10
    assert kv.pool.num_free_blocks == 100 - 4
    out = step(sched)
    # a decodes one token (its encoder does not run again); b is admitted with its encoder
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.encoder_runs == {"b": b.encoder_block_ids}
    assert out.total_num_scheduled_tokens == 12
    out = step(sched)
    assert out.encoder_runs == {} and out.total_num_scheduled_tokens == 2


def test_encoder_longer_than_a_step_is_refused():
    sched, _ = make(budget=16)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add_request(encdec("a", 16))


def test_preemption_frees_both_groups_and_reruns_the_encoder():
    # 8 blocks: each request holds 3 cross blocks + decoder blocks growing by one every 4 tokens
    sched, kv = make(num_blocks=8, budget=32)
    a, b = encdec("a", 12, max_tokens=10), encdec("b", 12, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert set(out.encoder_runs) == {"a", "b"} and kv.pool.num_free_blocks == 0
    for _ in range(3):  # 4 decoder tokens fill their first block
        out = step(sched)
    out = step(sched)  # a needs a second decoder block: b (the newest) gives way, both groups freed
    assert out.preempted_req_ids == ["b"] and b.status == RequestStatus.WAITING
    assert b.encoder_block_ids == [] and b.block_ids == []
    assert kv.pool.num_free_blocks == 4 - 1  # b's 3 cross + 1 decoder blocks back, a took one
    while a.status == RequestStatus.RUNNING:
        out = step(sched)
    # a finished: b comes back as resumed, its encoder runs again into fresh blocks
    resumed = [r for r in (out, step(sched)) if r.resumed_requests]
    assert resumed and resumed[0].encoder_runs == {"b": b.encoder_block_ids}
    assert resumed[0].resumed_requests[0].req_id == "b" and len(b.encoder_block_ids) == 3
    while b.status == RequestStatus.RUNNING or b.status == RequestStatus.WAITING:
        step(sched)
    assert b.output_token_ids == [7] * 10
    assert kv.pool.is_whole()


def test_abort_storm_leaves_the_pool_whole():
    rng = random.Random(3)
    sched, kv = make(num_blocks=24, budget=40, max_seqs=6)
    alive, n = [], 0
    for _ in range(60):
        if rng.random() < 0.5:
            r = encdec(f"r{n}", rng.randrange(1, 30), max_tokens=rng.randrange(1, 12))
            n += 1
            sched.add_request(r)
            alive.append(r.request_id)
        if alive and rng.random() < 0.4:
            sched.finish_requests(alive.pop(rng.randrange(len(alive))), RequestStatus.FINISHED_ABORTED)
        step(sched)
        held = sum(len(r.encoder_block_ids) + len(r.block_ids) for r in sched.running)
        assert held == kv.pool.num_blocks - kv.pool.num_free_blocks
    sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
    assert kv.pool.is_whole() and not sched.running and not sched.waiting


def test_decoder_blocks_are_shared_only_for_the_same_encoder_input():
    sched, kv = make(caching=True, budget=64)
    decoder_prompt = list(range(20, 29))  # 9 tokens: two full blocks can be hits
    first = encdec("a", 0, decoder_prompt, encoder_ids=[5, 6, 7])
    sched.add_request(first)
    step(sched)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    same = encdec("b", 0, decoder_prompt, encoder_ids=[5, 6, 7])
    other = encdec("c", 0, decoder_prompt, encoder_ids=[5, 6, 8])
    assert kv.get_computed_blocks(same)[1] == 8
    assert kv.get_computed_blocks(other)[1] == 0
