"""The priority scheduling policy (vLLM's `--scheduling-policy priority`): admission by (priority,
arrival), preemption of the lowest priority (largest value) first, even of a request already given
tokens in the step being built; and how prompt-logprob chunks reach a request."""
from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.request_queue import PriorityRequestQueue
from splitserve.core.scheduler import Scheduler
from splitserve.core.request import Request, RequestStatus
from splitserve.sampling_params import SamplingParams

from tests.core.test_scheduler import launch, plan, step


def make(policy, num_blocks=100, block_size=4, budget=100, max_seqs=10):
    kv = KVCacheManager(num_blocks, block_size, False)
    return Scheduler(SchedulerConfig(max_seqs, budget, policy), kv), kv


def req(rid, n_prompt, priority, arrival, max_tokens=10):
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_ids=(2,), max_total_tokens=1000, arrival_time=arrival, priority=priority)


def run_to_end(sched, kv):
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
    assert not sched.has_unfinished() and kv.pool.is_whole()


def admission_order(policy):
    sched, kv = make(policy, max_seqs=1)
    for rid, prio, arrival in (("a", 5, 1.0), ("b", 0, 2.0), ("c", 5, 3.0), ("d", -1, 4.0), ("e", 0, 5.0)):
        sched.add_request(req(rid, 3, prio, arrival))
    order = []
    while sched.has_unfinished():
        step(sched)
        running = sched.running[0]
        order.append(running.request_id)
        sched.finish_requests(running.request_id, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.is_whole()
    return order


def test_admission_by_priority_then_arrival():
    assert admission_order("priority") == ["d", "b", "e", "a", "c"]
    assert admission_order("fcfs") == ["a", "b", "c", "d", "e"]


def test_blocks_run_out_the_lowest_priority_is_preempted():
    # 6 blocks of 4: three 8-token prompts fill them; each one's next token needs a 7th block.
    sched, kv = make("priority", num_blocks=6)
    sched.add_request(req("hi", 8, 0, 1.0))
    sched.add_request(req("lo", 8, 5, 2.0))
    sched.add_request(req("mid", 8, 2, 3.0))
    assert plan(step(sched)) == [("hi", 8), ("mid", 8), ("lo", 8)]  # admitted by priority
    out = step(sched)
    assert plan(out) == [("hi", 1), ("mid", 1)] and out.preempted_req_ids == ["lo"]
    assert [r.request_id for r in sched.waiting] == ["lo"]
    run_to_end(sched, kv)


def test_fcfs_preempts_the_newest_instead():
    sched, kv = make("fcfs", num_blocks=6)
    sched.add_request(req("hi", 8, 0, 1.0))
    sched.add_request(req("lo", 8, 5, 2.0))
    sched.add_request(req("mid", 8, 2, 3.0))
    assert plan(step(sched)) == [("hi", 8), ("lo", 8), ("mid", 8)]
    out = step(sched)
    assert plan(out) == [("hi", 1), ("lo", 1)] and out.preempted_req_ids == ["mid"]
    run_to_end(sched, kv)


def late_high_priority(policy):
    """lo (priority 5) runs; hi (priority 0) arrives later, so it comes after lo in the running batch.
    At step 6 both need a new block and only one is left: lo takes it first (it comes first)."""
    sched, kv = make(policy, num_blocks=6)
    sched.add_request(req("lo", 8, 5, 1.0, max_tokens=12))
    step(sched)
    sched.add_request(req("hi", 5, 0, 2.0, max_tokens=12))
    assert plan(step(sched)) == [("lo", 1), ("hi", 5)]
    for _ in range(3):
        assert plan(step(sched)) == [("lo", 1), ("hi", 1)]
    out, _ = launch(sched)
    return sched, kv, out


def test_victim_already_scheduled_in_the_step_is_taken_out_of_it():
    sched, kv, out = late_high_priority("priority")
    assert plan(out) == [("hi", 1)] and out.preempted_req_ids == ["lo"]
    assert out.cached_requests.req_ids == ["hi"]  # lo's block grant is gone with it
    assert out.total_num_scheduled_tokens == 1
    lo = sched.requests["lo"]
    assert lo.status == RequestStatus.WAITING and lo.block_ids == [] and lo.num_computed_tokens == 0
    sched.update(out, {"hi": 7})
    run_to_end(sched, kv)


def test_same_layout_under_fcfs_preempts_the_newcomer():
    sched, kv, out = late_high_priority("fcfs")
    assert plan(out) == [("lo", 1)] and out.preempted_req_ids == ["hi"]
    sched.update(out, {"lo": 7})
    run_to_end(sched, kv)


def test_priority_queue_orders_and_removes():
    q = PriorityRequestQueue()
    a, b, c = req("a", 1, 1, 3.0), req("b", 1, 1, 1.0), req("c", 1, 0, 9.0)
    for r in (a, b, c):
        q.append(r)
    assert [r.request_id for r in q] == ["c", "b", "a"] and q[0] is c and len(q) == 3
    q.remove(b)
    assert b not in q and a in q
    assert [q.popleft().request_id for _ in range(2)] == ["c", "a"] and not q


def test_prompt_logprob_chunks_gather_and_recomputed_chunks_replace():
    sched, kv = make("fcfs", budget=4)
    r = Request("p", list(range(10, 20)), SamplingParams(max_tokens=2, prompt_logprobs=0), max_total_tokens=100)
    sched.add_request(r)
    chunk = lambda start, n: (start, [{start + i: -float(start + i)} for i in range(n)], [1] * n)  # noqa: E731
    out, _ = launch(sched)
    sched.update(out, {}, {"p": chunk(0, 4)})
    out, _ = launch(sched)
    sched.update(out, {}, {"p": chunk(4, 4)})
    assert len(r.prompt_logprobs) == 8
    sched.update(launch(sched)[0], {"p": 7}, {"p": chunk(8, 1)})
    assert [list(e) for e in r.prompt_logprobs] == [[i] for i in range(9)]
    r.add_prompt_logprobs(0, [{0: -1.0}], [3])  # a recomputation from the start replaces everything after
    assert r.prompt_logprobs == [{0: -1.0}] and r.prompt_logprob_ranks == [3]
