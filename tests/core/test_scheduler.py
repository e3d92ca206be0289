from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.scheduler import Scheduler
from splitserve.core.request import Request, RequestStatus
from splitserve.sampling_params import SamplingParams

EOS = 2


def make(num_blocks=100, block_size=4, budget=100, max_seqs=10, caching=False):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget), kv), kv


def req(rid, n_prompt, **params):
    params.setdefault("max_tokens", 50)
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(**params), eos_token_ids=(EOS,),
                   max_total_tokens=1000)


def scheduled(sched, out):
    """The step's (request, num tokens) pairs, in batch order."""
    return [(sched.requests[rid], n) for rid, n in out.num_scheduled_tokens.items()]


def launch(sched):
    """schedule + advance, as the engine does when it launches a step; returns (out, samplers)."""
    out = sched.schedule()
    samplers = [r for r, n in scheduled(sched, out) if r.num_computed_tokens + n == r.num_tokens]
    assert sched.advance(out) == len(samplers)
    assert all(r.num_pending for r in samplers)
    return out, samplers


def step(sched, token=7):
    out, samplers = launch(sched)
    sched.update(out, {r.request_id: token for r in samplers})
    return out


def plan(out):
    return list(out.num_scheduled_tokens.items())


def test_decode_first_then_chunked_prefill_under_budget():
    sched, kv = make(budget=10)
    sched.add_request(req("a", 6))
    assert plan(step(sched)) == [("a", 6)]
    sched.add_request(req("b", 20))
    assert plan(step(sched)) == [("a", 1), ("b", 9)]   # decode first, prefill takes the rest
    assert plan(step(sched)) == [("a", 1), ("b", 9)]
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 2)]           # b's last chunk samples its first token
    b = sched.requests["b"]
    assert b.num_computed_tokens == 20 and b.output_token_ids == [7]
    assert plan(step(sched)) == [("a", 1), ("b", 1)]


def test_max_num_seqs_caps_running():
    sched, _ = make(max_seqs=2)
    for rid in "abc":
        sched.add_request(req(rid, 3))
    assert plan(step(sched)) == [("a", 3), ("b", 3)]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_preemption_frees_the_newest_and_requeues_it_first():
    # 4 blocks of 4 tokens: a and b (8 prompt tokens each) fill 2 blocks each; a's next token needs a 3rd.
    sched, kv = make(num_blocks=4, block_size=4)
    sched.add_request(req("a", 8))
    sched.add_request(req("b", 8))
    step(sched)                                  # both prefilled, each sampled its first token
    assert kv.pool.num_free_blocks == 0
    out = step(sched)                            # a's decode needs a new block: b must go
    assert plan(out) == [("a", 1)]
    assert out.preempted_req_ids == ["b"]
    b = sched.requests["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert list(sched.waiting) == [b] and sched.num_preemptions == 1
    assert b.output_token_ids == [7]             # its output is kept and recomputed later
    assert kv.pool.num_free_blocks == 1


def test_lone_request_is_preempted_rather_than_spinning():
    sched, kv = make(num_blocks=2, block_size=4)
    sched.add_request(req("a", 8))
    out = step(sched)                            # 8 prompt tokens fill both blocks; 9th token sampled
    assert plan(out) == [("a", 8)]
    out = step(sched)                            # decode needs a third block that does not exist
    assert plan(out) == [] and out.preempted_req_ids == ["a"]
    assert kv.pool.is_whole()


def test_abort_waiting_and_running_returns_all_blocks():
    sched, kv = make(budget=8)
    sched.add_request(req("a", 5))
    sched.add_request(req("b", 30))
    sched.add_request(req("c", 3))
    step(sched)                                  # a fully, b partially
    done = sched.finish_requests(["b", "c", "zzz"], RequestStatus.FINISHED_ABORTED)
    assert sorted(r.request_id for r in done) == ["b", "c"]
    assert [r.request_id for r in sched.running] == ["a"] and not sched.waiting
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and kv.pool.is_whole()


def test_stop_rules():
    sched, kv = make()
    sched.add_request(req("eos", 3))
    sched.add_request(req("ignore", 3, ignore_eos=True, max_tokens=2))
    sched.add_request(req("stopid", 3, stop_token_ids=[7]))
    sched.add_request(req("min", 3, min_tokens=2))
    step(sched, token=EOS)
    assert sched.requests.get("eos") is None      # finished and released
    step(sched, token=7)
    assert "stopid" not in sched.requests
    assert "ignore" not in sched.requests         # max_tokens=2 reached (EOS ignored)
    r = sched.requests["min"]
    assert r.output_token_ids == [EOS, 7] and r.status == RequestStatus.RUNNING
    step(sched, token=EOS)
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert kv.pool.is_whole()


def test_length_cap_from_context():
    sched, kv = make()
    r = req("a", 4, max_tokens=None)
    r.max_total_tokens = 6
    sched.add_request(r)
    step(sched)
    assert r.status == RequestStatus.RUNNING
    step(sched)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 6
    assert kv.pool.is_whole()


# -- async scheduling: the next step is scheduled before the previous step's tokens are known -------

def test_pending_token_is_the_next_input_and_resolves_in_order():
    sched, kv = make(budget=100)
    a = req("a", 6)
    sched.add_request(a)
    out1, _ = launch(sched)                       # prefill: samples a's first token (pending)
    assert a.num_pending == 1 and a.num_tokens == 7 and a.num_known_tokens == 6
    out2, _ = launch(sched)                       # decode on the pending token, before it is known
    assert plan(out2) == [("a", 1)] and a.num_pending == 2
    assert a.token_slice(5, 8) == [15, 0, 0]      # pending tokens read as 0 (filled on the device)
    sched.update(out1, {"a": 40})
    sched.update(out2, {"a": 41})
    assert a.output_token_ids == [40, 41] and a.num_pending == 0 and a.num_computed_tokens == 7


def test_request_at_its_length_limit_is_not_scheduled_while_its_last_token_is_pending():
    sched, kv = make(budget=100)
    a = req("a", 4, max_tokens=2)
    sched.add_request(a)
    out1, _ = launch(sched)
    out2, _ = launch(sched)                       # the 2nd (last) token is now pending
    out3, _ = launch(sched)
    assert plan(out3) == [] and a.num_pending == 2
    sched.update(out1, {"a": 40})
    sched.update(out2, {"a": 41})
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [40, 41]
    assert kv.pool.is_whole()


def test_eos_in_flight_wastes_one_step_and_its_token_is_dropped():
    sched, kv = make(budget=100)
    a = req("a", 4)
    sched.add_request(a)
    out1, _ = launch(sched)
    out2, _ = launch(sched)                       # launched before out1's EOS is known
    sched.update(out1, {"a": EOS})
    assert a.status == RequestStatus.FINISHED_STOPPED and kv.pool.is_whole()
    assert sched.update(out2, {"a": 99}) == [] and a.output_token_ids == [EOS]


def test_request_preempted_while_its_token_is_in_flight_keeps_the_token():
    sched, kv = make(num_blocks=3, block_size=4, budget=100)
    a, b = req("a", 4), req("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    out1, _ = launch(sched)                       # both prefilled: 2 blocks, 1 token pending each
    out2, _ = launch(sched)                       # both need a 2nd block: b (last admitted) is preempted
    assert plan(out2) == [("a", 1)] and b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    sched.update(out1, {"a": 40, "b": 50})
    assert b.output_token_ids == [50] and b.num_pending == 0 and b.block_ids == []
    sched.update(out2, {"a": 41})
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out3, _ = launch(sched)                       # b is recomputed from its 5 known tokens
    assert plan(out3) == [("b", 5)]
    sched.update(out3, {"b": EOS})
    assert b.status == RequestStatus.FINISHED_STOPPED and kv.pool.is_whole()


def test_preempted_request_finished_by_its_in_flight_token_leaves_the_queue():
    sched, kv = make(num_blocks=3, block_size=4, budget=100)
    a, b = req("a", 4), req("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    out1, _ = launch(sched)
    launch(sched)                                 # b preempted, back in the waiting queue
    sched.update(out1, {"a": 40, "b": EOS})
    assert b.status == RequestStatus.FINISHED_STOPPED and b not in sched.waiting
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and kv.pool.is_whole()


def test_blocks_holding_pending_tokens_are_not_cached():
    sched, kv = make(block_size=4, caching=True)
    a = req("a", 6)
    sched.add_request(a)
    out1, _ = launch(sched)                       # prefill of 6; one token pending
    out2, _ = launch(sched)                       # two steps ahead of the host: 8 positions computed,
    launch(sched)                                 # the last two still pending
    sched.update(out1, {"a": 40})
    assert len(a.block_hashes) == 1               # block 2 (positions 4..7) still holds a pending token
    sched.update(out2, {"a": 41})
    assert len(a.block_hashes) == 2 and a.token_slice(4, 8) == [14, 15, 40, 41]


# -- the step message: plain data, full request data once, then deltas ------------------------------

def test_step_message_sends_a_request_once_then_block_additions():
    sched, kv = make(block_size=4)
    sched.add_request(req("a", 6, temperature=0.5, seed=3))
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 6} and out.total_num_scheduled_tokens == 6
    [new] = out.new_requests
    a = sched.requests["a"]
    assert (new.req_id, new.prompt_token_ids, new.num_computed_tokens) == ("a", list(range(10, 16)), 0)
    assert new.block_ids == a.block_ids and len(new.block_ids) == 2
    assert new.sampling_params.seed == 3 and new.eos_token_ids == (EOS,)
    assert not out.cached_requests.req_ids and not out.resumed_requests
    out = step(sched)                            # position 6 fits in block 2: nothing new to send
    assert out.num_scheduled_tokens == {"a": 1} and not out.new_requests and not out.cached_requests.req_ids
    out = step(sched)                            # position 7 still fits
    assert not out.cached_requests.req_ids
    out = step(sched)                            # position 8 opens a 3rd block: only that id is sent
    assert out.cached_requests.req_ids == ["a"] and out.cached_requests.new_block_ids == [a.block_ids[2:]]
    assert len(a.block_ids) == 3 and not out.new_requests


def test_step_message_reports_finished_ids_once():
    sched, kv = make()
    for rid in ("s", "r", "w"):
        sched.add_request(req(rid, 3, max_tokens=1 if rid == "s" else 50))
    sched.config = SchedulerConfig(2, 100)       # "w" waits: two sequences at most
    out = step(sched)                            # s ends by length in its first step
    assert plan(out) == [("s", 3), ("r", 3)] and not out.finished_req_ids
    sched.finish_requests(["r", "w"], RequestStatus.FINISHED_ABORTED)  # w was never sent: not reported
    out = sched.schedule()
    assert out.is_empty and out.has_removals and out.finished_req_ids == ["s", "r"]
    out = sched.schedule()
    assert not out.finished_req_ids and not out.has_removals
    assert kv.pool.is_whole()


def test_step_message_preempts_then_resumes_with_a_new_block_table():
    sched, kv = make(num_blocks=4, block_size=4)
    sched.add_request(req("a", 8))
    sched.add_request(req("b", 8))
    step(sched)
    out = step(sched)                            # b gives way to a's third block
    b = sched.requests["b"]
    assert out.preempted_req_ids == ["b"] and "b" not in out.num_scheduled_tokens
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = step(sched)                            # b runs again: resumed, not new, all its 9 tokens recomputed
    assert out.finished_req_ids == ["a"] and not out.preempted_req_ids
    assert not out.new_requests and plan(out) == [("b", 9)]
    [resumed] = out.resumed_requests
    assert (resumed.req_id, resumed.block_ids, resumed.num_computed_tokens) == ("b", b.block_ids, 0)
    assert len(b.block_ids) == 3 and b.output_token_ids == [7, 7]


def test_resumed_request_starts_after_its_prefix_hits():
    sched, kv = make(num_blocks=5, block_size=4, caching=True)
    sched.add_request(req("a", 8))
    sched.add_request(req("b", 9))
    step(sched)                                  # a: 2 blocks, b: 3 blocks (9 prompt tokens), 0 free
    out = step(sched)                            # a needs a 3rd block: b is preempted (its blocks stay cached)
    assert out.preempted_req_ids == ["b"]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = step(sched)
    [resumed] = out.resumed_requests
    assert resumed.num_computed_tokens == 8 and plan(out) == [("b", 2)]  # 2 full blocks hit, 2 tokens to go


def test_removals_of_a_message_that_failed_to_launch_go_out_again():
    sched, kv = make(num_blocks=4, block_size=4)
    sched.add_request(req("a", 8))
    sched.add_request(req("b", 8))
    sched.add_request(req("x", 2))
    sched.config = SchedulerConfig(2, 100)
    step(sched)
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()                       # a needs a block: b preempted; this launch fails
    assert out.preempted_req_ids == ["b"] and plan(out) == [("a", 1)]
    failed = sched.fail_step(out, RequestStatus.FINISHED_ERROR, launched=False)
    assert [r.request_id for r in failed] == ["a"] and sched.requests["b"].status == RequestStatus.WAITING
    out = sched.schedule()                       # the worker never saw the failed message
    assert out.preempted_req_ids == ["b"] and out.finished_req_ids == ["a"]
    assert [r.req_id for r in out.resumed_requests] == ["b"]


def test_step_message_survives_msgpack():
    from splitserve.protocol.sched_output import SchedulerOutput
    from splitserve.protocol.core_messages import Codec
    sched, kv = make(block_size=4)
    sched.add_request(req("a", 6, temperature=0.7, top_p=0.9, seed=5, stop_token_ids=[9]))
    out = sched.schedule()
    codec = Codec(SchedulerOutput)
    back = codec.decode(codec.encode(out))
    assert back == out and list(back.num_scheduled_tokens) == list(out.num_scheduled_tokens)
    assert back.new_requests[0].sampling_params == out.new_requests[0].sampling_params


# -- the prefix cache -------------------------------------------------------------------------------

def test_request_ending_in_its_first_step_leaves_its_prompt_blocks_cached():
    sched, kv = make(block_size=4, caching=True)
    sched.add_request(req("a", 10, max_tokens=1))
    step(sched)                                  # prefill + the only token: finished and released
    assert "a" not in sched.requests and kv.pool.is_whole()
    sched.add_request(req("b", 10, max_tokens=1))
    out = step(sched)
    assert kv.prefix_hits == 8                   # both full blocks of the identical prompt
    assert out.new_requests[0].num_computed_tokens == 8 and plan(out) == [("b", 2)]
    assert kv.pool.is_whole()
