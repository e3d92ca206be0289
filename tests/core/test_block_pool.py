import pytest

from splitserve.core.block_pool import BlockPool
from splitserve.protocol.block_hash import hash_block


def cache(pool, block, tokens, parent=None):
    h = hash_block(parent, tokens)
    pool.cache_block(block, h, parent, tokens)
    return h


def test_allocate_takes_least_recently_freed_and_free_returns_everything():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.num_free_blocks == 1
    pool.free([a[2], a[1], a[0]])  # tail first
    # Free order: 3 (never used), then 2, 1, 0.
    assert [b.block_id for b in pool.allocate(4)] == [3, 2, 1, 0]
    assert pool.num_free_blocks == 0


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2 and pool.is_whole()


def test_ref_counts_and_double_free():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h = cache(pool, b, (1, 2))
    pool.touch([pool.lookup(h, None, (1, 2))])
    assert b.ref_cnt == 2
    pool.free([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([b])
    assert pool.is_whole()
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_freed_block_keeps_its_hash_until_reallocated():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h = cache(pool, b, (5, 6))
    pool.free([b])
    assert pool.lookup(h, None, (5, 6)) is b  # still cached while free
    pool.touch([b])  # revived: leaves the free queue
    assert pool.num_free_blocks == 1 and b.ref_cnt == 1
    pool.free([b])
    # Allocating both blocks evicts the hash of the reused one.
    pool.allocate(2)
    assert pool.lookup(h, None, (5, 6)) is None and b.block_hash is None


def test_lookup_confirms_tokens_and_parent():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h = cache(pool, b, (1, 2), parent=99)
    assert pool.lookup(h, 99, (1, 2)) is b
    assert pool.lookup(h, 98, (1, 2)) is None
    assert pool.lookup(h, 99, (1, 3)) is None


def test_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    h = cache(pool, b, (1, 2))
    assert pool.lookup(h, None, (1, 2)) is None


def test_usage_and_reset():
    pool = BlockPool(4)
    blocks = pool.allocate(1)
    assert pool.usage() == 0.25
    h = cache(pool, blocks[0], (1,))
    pool.reset_prefix_cache()
    assert pool.lookup(h, None, (1,)) is None
    pool.free(blocks)
    assert pool.usage() == 0.0 and pool.is_whole()
