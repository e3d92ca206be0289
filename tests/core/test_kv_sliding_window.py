"""KV manager with a sliding window on every layer: blocks wholly before the next query's window go
back to the pool as the sequence advances; exact block counts, the pool whole after finish, abort and
preemption, and prefix caching still correct."""
import pytest

from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.scheduler import Scheduler
from splitserve.core.request import Request, RequestStatus
from splitserve.sampling_params import SamplingParams


def req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_total_tokens=1000)


def held(kv, r):
    """Block ids the request still holds (its list without the positions the window freed)."""
    return [b.block_id for b in kv._blocks.get(r.request_id, []) if b is not None]


def decode(kv, r, token=5):
    """One decode step for r: room for its next token, then as if the step ran."""
    r.output_token_ids.append(token)
    assert kv.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    kv.cache_full_blocks(r)


def test_window_frees_exactly_the_passed_blocks():
    bs, window = 4, 6
    kv = KVCacheManager(10, bs, enable_prefix_caching=False, sliding_window=window)
    r = req("a", range(10))
    assert kv.allocate_slots(r, 10)              # prefill: the step needs all 3 blocks
    first = list(r.block_ids)
    r.num_computed_tokens = 10
    for _ in range(20):
        decode(kv, r)
        # After the step the query at p = num_computed_tokens - 1 was computed; at allocation the
        # next query (position num_computed_tokens - 1 before the increment) sees positions >=
        # p - window + 1, so blocks ending at or before that are free.
        p = r.num_computed_tokens - 1            # the position the last allocation was for
        passed = max(0, p - window + 1) // bs
        total = -(-(p + 1) // bs)
        assert len(r.block_ids) == total                      # the table keeps every position
        assert len(held(kv, r)) == total - passed
        assert kv.pool.num_free_blocks == 10 - (total - passed)
        assert held(kv, r) == r.block_ids[passed:]
    # With window 6 and blocks of 4 a request never holds more than 3 blocks (positions p-5..p).
    assert first[0] not in held(kv, r) and kv.pool.blocks[first[0]].ref_cnt == 0
    kv.free(r)
    assert kv.pool.is_whole() and r.block_ids == []


def test_long_generation_fits_a_pool_smaller_than_its_context():
    kv = KVCacheManager(3, 4, enable_prefix_caching=True, sliding_window=5)
    r = req("a", range(6), max_tokens=100)
    hits, _ = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, 6, hits)
    r.num_computed_tokens = 6
    kv.cache_full_blocks(r)
    for _ in range(60):                         # 66 tokens = 17 blocks of context on a 3-block pool
        decode(kv, r, token=len(r.output_token_ids) + 1000)
    assert len(r.block_ids) == 17 and len(held(kv, r)) <= 3
    kv.free(r)
    assert kv.pool.is_whole()


def test_no_window_frees_nothing_early():
    kv = KVCacheManager(10, 4, enable_prefix_caching=False, sliding_window=None)
    r = req("a", range(10))
    assert kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    for _ in range(10):
        decode(kv, r)
    assert len(held(kv, r)) == 5 == len(r.block_ids)
    kv.free(r)
    assert kv.pool.is_whole()


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(4, 4, sliding_window=0)


def test_shared_prefix_blocks_stay_until_every_holder_passed_them():
    kv = KVCacheManager(12, 4, enable_prefix_caching=True, sliding_window=4)
    a = req("a", range(9))
    hits, _ = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 9, hits)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    b = req("b", list(range(8)) + [99])
    hits, cached = kv.get_computed_blocks(b)
    assert cached == 8                           # both of a's full blocks: the window has not passed them yet
    assert kv.allocate_slots(b, 1, hits)
    # b's next query (position 8) sees 5..8: block 0 (0..3) was passed at admission, block 1 not.
    assert kv.pool.blocks[a.block_ids[0]].ref_cnt == 1 and kv.pool.blocks[a.block_ids[1]].ref_cnt == 2
    assert held(kv, b) == b.block_ids[1:]
    b.num_computed_tokens = 9
    decode(kv, a)                                 # a: allocation for position 9, sees 6..9, frees block 0
    assert kv.pool.blocks[a.block_ids[0]].ref_cnt == 0
    assert kv.pool.blocks[a.block_ids[0]].block_hash is not None  # free, but still a valid prefix hit
    c = req("c", list(range(8)) + [42, 43])
    hits, cached = kv.get_computed_blocks(c)
    assert cached == 8 and [h.block_id for h in hits] == a.block_ids[:2]
    for r in (a, b):
        kv.free(r)
    assert kv.pool.is_whole()


def test_freed_block_taken_by_another_request_is_not_registered_or_hit():
    """A block the window freed before its request registered it, then handed to another request, is
    never registered under the first request's hash, and its prefix no longer hits."""
    kv = KVCacheManager(4, 4, enable_prefix_caching=True, sliding_window=2)
    a = req("a", range(6))
    assert kv.allocate_slots(a, 6)               # no cache_full_blocks yet (as with a step in flight)
    a.num_computed_tokens = 6
    a_first = a.block_ids[0]
    kv.pool.reset_prefix_cache()                 # as if nothing was registered before the window passed
    kv._num_registered.pop("a", None)
    kv.pool.cache_block = lambda *args: None     # nothing registers until the block has changed hands
    assert kv.allocate_slots(a, 1)               # query at 6 sees 5..6: block 0 freed
    assert kv.pool.blocks[a_first].ref_cnt == 0
    other = req("other", [500 + i for i in range(9)])
    assert kv.allocate_slots(other, 9)           # takes every free block, a's old block 0 included
    assert a_first in other.block_ids
    del kv.pool.cache_block                      # registering works again
    kv.cache_full_blocks(a)
    assert kv.pool.blocks[a_first].block_hash is None or kv.pool.blocks[a_first].token_ids[0] >= 500
    d = req("d", range(6))
    assert kv.get_computed_blocks(d) == ([], 0)
    for r in (a, other):
        kv.free(r)
    assert kv.pool.is_whole()


# -------------------------------------------------------------------------------- with the scheduler

def run_scheduler(sched, abort_after=None, max_steps=500):
    """Runs steps (each sampled token 7), optionally aborting a request after some step."""
    steps = 0
    while sched.has_unfinished() and steps < max_steps:
        out = sched.schedule()
        samplers = [rid for rid, n in out.num_scheduled_tokens.items()
                    if sched.requests[rid].num_computed_tokens + n == sched.requests[rid].num_tokens]
        sched.advance(out)
        sched.update(out, {rid: 7 for rid in samplers})
        steps += 1
        if abort_after and steps == abort_after[0]:
            sched.finish_requests(abort_after[1], RequestStatus.FINISHED_ABORTED)
    return steps


@pytest.mark.parametrize("caching", [False, True])
def test_scheduler_with_window_preemptions_and_abort_leaves_the_pool_whole(caching):
    kv = KVCacheManager(7, 4, enable_prefix_caching=caching, sliding_window=12)
    sched = Scheduler(SchedulerConfig(4, 16), kv)
    for i in range(5):
        sched.add_request(Request(f"r{i}", [10 + i] * 3 + list(range(20, 29)), SamplingParams(max_tokens=30),
                                  eos_token_ids=(2,), max_total_tokens=1000))
    run_scheduler(sched, abort_after=(12, ["r3"]))
    assert not sched.has_unfinished()
    assert sched.num_preemptions > 0                 # the pool was tight enough to preempt
    assert kv.pool.is_whole()


def test_scheduler_serves_context_longer_than_the_pool():
    """Without freeing, 12 + 40 tokens need 13 blocks of 4; the pool holds 4 and the window is 6."""
    kv = KVCacheManager(4, 4, enable_prefix_caching=True, sliding_window=6)
    sched = Scheduler(SchedulerConfig(2, 16), kv)
    r = Request("a", list(range(12)), SamplingParams(max_tokens=40), eos_token_ids=(2,), max_total_tokens=1000)
    sched.add_request(r)
    run_scheduler(sched)
    assert r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 40
    assert sched.num_preemptions == 0 and kv.pool.is_whole()


def test_passed_blocks_are_registered_before_they_are_freed():
    """With a step in flight its results (and cache_full_blocks) come after the next allocation:
    a filled block the window passes meanwhile is offered to the prefix cache as it is freed."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, sliding_window=4)
    a = req("a", range(12))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12                   # launched, results not processed: nothing registered
    assert kv.allocate_slots(a, 1)               # position 12 sees 9..12: blocks 0 and 1 freed
    assert held(kv, a) == a.block_ids[2:]
    b = req("b", list(range(8)) + [77])
    hits, cached = kv.get_computed_blocks(b)
    assert cached == 8 and [h.block_id for h in hits] == a.block_ids[:2]
    kv.free(a)
    assert kv.pool.is_whole()
