from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.scheduler import Scheduler
from splitserve.request import Request, RequestStatus
from splitserve.sampling_params import SamplingParams

EOS = 2


def make(num_blocks=100, block_size=4, budget=100, max_seqs=10, caching=False):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget), kv), kv


def req(rid, n_prompt, **params):
    params.setdefault("max_tokens", 50)
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(**params), eos_token_ids=(EOS,),
                   max_total_tokens=1000)


def step(sched, token=7):
    out = sched.schedule()
    sampled = {r.request_id: token for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    sched.update(out, sampled)
    return out


def plan(out):
    return [(r.request_id, n) for r, n in out.scheduled]


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
    assert [r.request_id for r in out.preempted] == ["b"]
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
    assert plan(out) == [] and [r.request_id for r in out.preempted] == ["a"]
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
