"""The scheduler's side of speculative decoding: drafts budgeted and capped (max_tokens, context,
budget, disable_by_batch_size, requests that may not speculate), accepted runs applied token by token
under the stop rules, rejected drafts rolled back exactly (computed counts, prefix-cache registration),
and the block pool whole after finishes, aborts and preemptions."""
from __future__ import annotations

from splitserve.config import SchedulerConfig, SpeculativeConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.request import Request, RequestStatus
from splitserve.core.scheduler import Scheduler
from splitserve.sampling_params import SamplingParams

EOS = 2


def make(num_blocks=100, block_size=4, budget=100, max_seqs=10, caching=True, k=3, method="ngram", **spec):
    kv = KVCacheManager(num_blocks, block_size, caching)
    spec.setdefault("adaptive", False)  # a fixed k here; the adaptive plan: tests/core/test_spec_control.py
    cfg = SpeculativeConfig(method, k, model="draft" if method == "draft_model" else None, **spec)
    return Scheduler(SchedulerConfig(max_seqs, budget), kv, spec=cfg), kv


def req(rid, n_prompt, max_total=1000, **params):
    params.setdefault("max_tokens", 50)
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(**params), eos_token_ids=(EOS,),
                   max_total_tokens=max_total)


def run(sched, results, drafts=None):
    """One step: schedule, advance, update with results {id: [tokens]} (first + accepted run) and the
    proposals `drafts` {id: [ids]}; returns the step message."""
    out = sched.schedule()
    sched.advance(out)
    sampled = {rid: toks[0] for rid, toks in results.items() if rid in out.num_scheduled_tokens}
    more = {rid: toks[1:] for rid, toks in results.items() if len(toks) > 1}
    sched.update(out, sampled, None, more, drafts or {})
    return out


def test_drafts_scheduled_verified_and_rolled_back():
    sched, kv = make()
    a = req("a", 6)
    sched.add_request(a)
    out = run(sched, {"a": [7]}, {"a": [20, 21, 22, 23]})  # prefill; 4 proposals, k = 3
    assert out.num_scheduled_tokens == {"a": 6} and not out.spec_token_ids
    out = run(sched, {"a": [20, 21, 30]}, {"a": [31]})  # 3 drafts, 2 accepted, then 30
    assert out.num_scheduled_tokens == {"a": 4} and out.spec_token_ids == {"a": [20, 21, 22]}
    assert a.output_token_ids == [7, 20, 21, 30] and a.num_new_tokens == 3
    # computed: prompt 6 + 7, 20, 21 (30 is the next input); the rejected draft's slot rolled back
    assert a.num_computed_tokens == 9 == a.num_tokens - 1
    assert (sched.spec_num_drafts, sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens) == (1, 3, 2)
    assert sched.spec_accepted_per_pos == [1, 1, 0]
    out = run(sched, {"a": [40]})  # the one draft rejected
    assert out.spec_token_ids == {"a": [31]} and a.num_computed_tokens == 10 and a.output_token_ids[-1] == 40
    out = run(sched, {"a": [41]})  # no proposal: a plain decode
    assert out.num_scheduled_tokens == {"a": 1} and not out.spec_token_ids


def test_prefix_cache_never_registers_rejected_slots():
    """Block size 4: the verify step computes positions 7..10 (last token + 3 drafts), all rejected:
    only the block wholly within the verified tokens is registered."""
    sched, kv = make(block_size=4)
    a = req("a", 7)
    sched.add_request(a)
    run(sched, {"a": [7]}, {"a": [50, 51, 52]})
    run(sched, {"a": [60]})  # all three drafts rejected
    assert a.num_computed_tokens == 8 and a.num_known_tokens == 9
    registered = [b for b in kv.pool.blocks if b.block_hash is not None]
    assert len(registered) == 2  # positions 0-7: the prompt and the verified first token
    assert registered[1].token_ids == (14, 15, 16, 7)
    b = req("b", 7)
    b.prompt_token_ids = list(range(10, 17)) + [7, 50, 51, 52]  # the rejected drafts as its prompt
    hits, n = kv.get_computed_blocks(b)
    assert n == 8  # two hits; the block that held the drafts' K/V is not offered


def test_drafts_never_overshoot_max_tokens_or_context():
    sched, _ = make(k=4)
    a, b = req("a", 5, max_tokens=3), req("b", 5, max_total=8)
    sched.add_request(a)
    sched.add_request(b)
    run(sched, {"a": [7], "b": [7]}, {"a": [1, 1, 1, 1], "b": [1, 1, 1, 1]})
    out = sched.schedule()
    # a: 1 output, max_tokens 3 -> at most 1 draft (accepted run + 1 = 2 more tokens);
    # b: 6 tokens known, context 8 -> at most 1 draft
    assert out.spec_token_ids == {"a": [1], "b": [1]}


def test_stop_inside_an_accepted_run_drops_the_rest():
    sched, kv = make()
    a = req("a", 5)
    sched.add_request(a)
    run(sched, {"a": [7]}, {"a": [8, EOS, 9]})
    run(sched, {"a": [8, EOS, 9, 10]})
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [7, 8, EOS]
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_who_does_not_speculate():
    sched, _ = make(disable_by_batch_size=3)
    reqs = [req("pen", 4, repetition_penalty=1.2), req("minimum", 4, min_tokens=5), req("plain", 4)]
    for r in reqs:
        sched.add_request(r)
    drafts = {r.request_id: [1, 1] for r in reqs}
    run(sched, {r.request_id: [7] for r in reqs}, drafts)
    out = run(sched, {r.request_id: [7] for r in reqs}, drafts)
    assert not out.spec_token_ids  # three running: disable_by_batch_size reached
    sched.finish_requests("plain", RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    assert not out.spec_token_ids  # penalties: never; min_tokens 5 not reached (2 outputs)


def test_pool_whole_after_abort_and_preemption_with_drafts():
    # 5 blocks of 4; two requests of 7 prompt tokens; drafts need a third block each, so one is preempted.
    sched, kv = make(num_blocks=5, block_size=4, k=4, caching=False)
    a, b = req("a", 7), req("b", 7)
    sched.add_request(a)
    sched.add_request(b)
    run(sched, {"a": [7], "b": [7]}, {"a": [1, 1, 1, 1], "b": [1, 1, 1, 1]})
    out = run(sched, {"a": [1, 1, 1, 1, 5]}, {"a": [1, 1, 1, 1]})
    assert b.num_preemptions == 1 and b.status == RequestStatus.WAITING and not b.spec_token_ids
    assert out.spec_token_ids == {"a": [1, 1, 1, 1]} and a.num_computed_tokens == 12
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert kv.pool.is_whole()


def test_draft_model_holds_lookahead_slots():
    sched, kv = make(block_size=4, k=3, method="draft_model")
    a = req("a", 4)
    sched.add_request(a)
    run(sched, {"a": [7]})
    assert len(a.block_ids) == 2  # 4 prompt + 3 lookahead slots (the draft's K/V after the first token)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert kv.pool.is_whole()
