from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.request import Request
from splitserve.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), max_total_tokens=1000)


def admit(kv, r):
    hits, cached = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - cached, hits)
    r.num_computed_tokens = r.num_tokens  # as if the step ran
    kv.cache_full_blocks(r)
    return cached


def test_allocate_rounds_up_to_blocks():
    kv = KVCacheManager(10, 4)
    r = req("a", range(9))
    assert kv.allocate_slots(r, 9)
    assert len(r.block_ids) == 3
    r.num_computed_tokens = 9
    assert kv.allocate_slots(r, 3)  # 12 tokens still fit in 3 blocks
    assert len(r.block_ids) == 3
    assert kv.allocate_slots(r, 4)  # 13 need a 4th
    assert len(r.block_ids) == 4
    kv.free(r)
    assert kv.pool.is_whole() and r.block_ids == []


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(2, 4)
    r = req("a", range(9))
    assert not kv.allocate_slots(r, 9)
    assert r.block_ids == [] and kv.pool.num_free_blocks == 2


def test_prefix_hit_shares_full_blocks_and_leaves_last_token():
    kv = KVCacheManager(10, 4)
    a = req("a", range(10))
    assert admit(kv, a) == 0
    b = req("b", list(range(8)) + [77, 78])
    assert admit(kv, b) == 8  # two full blocks shared
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert kv.pool.blocks[a.block_ids[0]].ref_cnt == 2
    # An identical 8-token prompt hits only one block: the last token must be computed.
    c = req("c", range(8))
    assert admit(kv, c) == 4
    assert kv.prefix_hits == 12 and kv.prefix_queries == 10 + 10 + 8
    for r in (a, b, c):
        kv.free(r)
    assert kv.pool.is_whole()


def test_freed_prefix_is_revived_and_counted_against_free_blocks():
    kv = KVCacheManager(3, 4)
    a = req("a", range(9))
    admit(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    # Tail freed first, so the 2 prefix blocks are evicted last.
    b = req("b", list(range(8)) + [50])
    hits, cached = kv.get_computed_blocks(b)
    assert cached == 8
    assert kv.allocate_slots(b, 1, hits)
    assert b.block_ids[:2] == a_blocks[:2] and b.block_ids[2] == a_blocks[2]  # the tail block reused
    kv.free(b)
    assert kv.pool.is_whole()


def test_different_prefix_same_block_tokens_do_not_hit():
    kv = KVCacheManager(10, 4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    b = req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # second block equal, first differs
    assert admit(kv, b) == 0
    kv.free(a), kv.free(b)
    assert kv.pool.is_whole()


def test_prefix_caching_off():
    kv = KVCacheManager(10, 4, enable_prefix_caching=False)
    a = req("a", range(9))
    admit(kv, a)
    b = req("b", range(9))
    assert admit(kv, b) == 0
    kv.free(a), kv.free(b)
    assert kv.pool.is_whole()
