"""Prefill sharing (Scheduler._reserve): a prompt being chunked leaves room for short waiting prompts
at the queue's head, so they get their first token in the step they are admitted instead of after
the long prompt's last chunk; at most half the budget, in queue order, no request passed over."""
from tests.core.test_scheduler import make, plan, req, step

from splitserve.ttft_trace import BASELINE_ENV


def _first_token_step(sched, rid, limit=20):
    for k in range(1, limit + 1):
        step(sched)
        r = sched.requests.get(rid)
        if r is None or r.output_token_ids:
            return k
    raise AssertionError(f"{rid} got no token in {limit} steps")


def test_short_prompt_runs_beside_a_chunked_long_one():
    sched, kv = make(budget=16, num_blocks=200)
    sched.add_request(req("long", 64))
    assert plan(step(sched)) == [("long", 16)]
    sched.add_request(req("short", 5))
    # the long prompt leaves the short one its 5 tokens (<= half of 16) and takes the rest
    assert plan(step(sched)) == [("long", 11), ("short", 5)]
    assert sched.requests["short"].output_token_ids == [7]
    # then the short one decodes beside the long prompt's chunks; the long one keeps going
    assert plan(step(sched)) == [("long", 15), ("short", 1)]


def test_baseline_waits_for_the_long_prompt(monkeypatch):
    monkeypatch.setenv(BASELINE_ENV, "1")
    sched, _ = make(budget=16, num_blocks=200)
    sched.add_request(req("long", 64))
    step(sched)
    sched.add_request(req("short", 5))
    assert _first_token_step(sched, "short") == 4  # the 3 remaining chunks of 16 first


def test_reserve_is_at_most_half_the_budget_and_in_queue_order():
    sched, _ = make(budget=16, num_blocks=200)
    sched.add_request(req("long", 64))
    step(sched)
    for rid, n in (("s1", 3), ("s2", 4), ("big", 9), ("s3", 1)):
        sched.add_request(req(rid, n))
    out = step(sched)
    # s1 + s2 = 7 fit in half of 16; "big" does not, and s3 is not taken past it; the long prompt
    # keeps 9, and the waiting loop gives what is left (0) to nobody else
    assert plan(out) == [("long", 9), ("s1", 3), ("s2", 4)]


def test_no_reserve_without_a_chunked_prompt_or_waiting_requests():
    sched, _ = make(budget=16, num_blocks=200)
    sched.add_request(req("a", 40))
    assert plan(step(sched)) == [("a", 16)]
    assert plan(step(sched)) == [("a", 16)]  # nobody waits: the whole budget
    sched.add_request(req("b", 12))  # longer than half the budget: no reserve, FCFS as before
    assert plan(step(sched)) == [("a", 8), ("b", 8)]


def test_long_prompt_still_finishes_under_a_stream_of_short_ones():
    sched, kv = make(budget=16, num_blocks=400, max_seqs=50)
    sched.add_request(req("long", 64))
    for k in range(12):
        sched.add_request(req(f"s{k}", 8, max_tokens=1))  # each one would take half of every step
        step(sched)
        if sched.requests["long"].output_token_ids:
            break
    # at least half of each step it shares with them: 16 + 6 x 8 = 64 tokens in 7 steps
    assert sched.requests["long"].output_token_ids and k == 6
    assert kv.pool.num_free_blocks + sum(len(r.block_ids) for r in sched.requests.values()) == 400


def test_decodes_admitted_after_a_long_prompt_are_not_starved_by_its_chunks():
    sched, _ = make(budget=16, num_blocks=200)
    sched.add_request(req("long", 80))
    step(sched)
    sched.add_request(req("a", 4))
    sched.add_request(req("b", 4))
    assert plan(step(sched)) == [("long", 8), ("a", 4), ("b", 4)]
    # a and b decode behind the long prompt in the running list: it leaves them their token
    assert plan(step(sched)) == [("long", 14), ("a", 1), ("b", 1)]
