"""TcpConnector between two in-process pools (no model), and the offload tier under the KV manager:
the bytes that arrive are the bytes that were sent, handshakes refuse other layouts, an unreachable
producer is a failed load within the timeout, and acknowledgements and leases free held blocks."""
import time

import pytest
import torch

from splitserve.config import KVTransferConfig, parse_kv_transfer_config
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.request import Request
from splitserve.kv_transfer.offload import OffloadingConnector
from splitserve.kv_transfer.pool import KVPool
from splitserve.kv_transfer.tcp import TcpConnector
from splitserve.sampling_params import SamplingParams

BS = 4


def pool(num_blocks=16, layers=2, heads=2, dim=8, dtype=torch.float32, block_size=BS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return KVPool([torch.randn(num_blocks, 2, block_size, heads, dim, generator=g).to(dtype) for _ in range(layers)])


def blocks_of(p: KVPool, ids):
    return torch.stack([c[ids] for c in p.caches], dim=1)


def wait_loads(conn, n=1, timeout=10.0):
    done, released = [], []
    deadline = time.monotonic() + timeout
    while len(done) < n and time.monotonic() < deadline:
        d, r = conn.poll()
        done += d
        released += r
        time.sleep(0.01)
    return done, released


def wait_until(check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def pair():
    prod = TcpConnector(KVTransferConfig("TcpConnector", "kv_producer", kv_port=0, kv_lease_duration=30), pool(seed=1))
    cons = TcpConnector(KVTransferConfig("TcpConnector", "kv_consumer", kv_load_timeout=2), pool(seed=2))
    yield prod, cons
    prod.shutdown()
    cons.shutdown()


def test_blocks_move_bytes_exact_and_ack_releases(pair):
    prod, cons = pair
    params = prod.save("p1", {"do_remote_decode": True}, [5, 9, 3, 7], num_prompt_tokens=10)
    assert params["remote_block_ids"] == [5, 9, 3] and params["remote_port"] == prod.port  # prompt blocks only
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "p1"
    assert cons.lookup("d1", params, 10, 1) == 2           # one block was a local prefix hit
    cons.load_async("d1", params, [0, 11, 12], first_block=1, num_prompt_tokens=10)
    [done], _ = wait_loads(cons)
    assert done.ok and done.num_tokens == 10
    assert torch.equal(blocks_of(cons.pool, [11, 12]), blocks_of(prod.pool, [9, 3]))
    assert not torch.equal(blocks_of(cons.pool, [0]), blocks_of(prod.pool, [5]))  # the hit was not overwritten
    assert wait_until(lambda: not prod._held)  # acknowledged ...
    assert prod.busy                             # ... but busy until the core has taken that in
    assert prod.poll()[1] == ["p1"] and not prod.busy
    assert cons.stats.recv_tokens == 6 and cons.stats.recv_bytes == prod.stats.sent_bytes > 0


def test_unreachable_producer_fails_within_the_timeout():
    cons = TcpConnector(KVTransferConfig("TcpConnector", "kv_consumer", kv_load_timeout=0.5), pool())
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": [0],
              "remote_request_id": "x", "remote_engine_id": "gone"}
    t = time.monotonic()
    try:
        cons.load_async("d", params, [4], 0, 3)
        [done], _ = wait_loads(cons, timeout=10)
        assert not done.ok and done.recoverable and "did not answer" in done.error
        assert time.monotonic() - t < 5 and cons.stats.failed == 1
        assert not cons.busy
    finally:
        cons.shutdown()


def test_layout_mismatch_is_refused_at_the_handshake():
    prod = TcpConnector(KVTransferConfig("TcpConnector", "kv_producer", kv_port=0), pool(block_size=8))
    cons = TcpConnector(KVTransferConfig("TcpConnector", "kv_consumer"), pool(dtype=torch.bfloat16))
    try:
        params = prod.save("p", {"do_remote_decode": True}, [1], 5)
        cons.load_async("d", params, [2, 3], 0, 5)
        [done], _ = wait_loads(cons)
        assert not done.ok and not done.recoverable
        assert "block_size: local 4, remote 8" in done.error and "dtype: local 'bfloat16'" in done.error
    finally:
        prod.shutdown()
        cons.shutdown()


def test_unread_blocks_go_back_at_lease_end():
    prod = TcpConnector(KVTransferConfig("TcpConnector", "kv_producer", kv_port=0, kv_lease_duration=0.2), pool())
    try:
        prod.save("p", {"do_remote_decode": True}, [1, 2], 6)
        assert prod.poll() == ([], []) and prod.busy
        time.sleep(0.3)
        assert prod.poll() == ([], ["p"]) and not prod.busy
    finally:
        prod.shutdown()


def test_discarded_blocks_go_back_before_the_lease(pair):
    """A reader that will not read (its request was aborted before loading) tells the producer."""
    prod, cons = pair
    params = prod.save("p", {"do_remote_decode": True}, [1, 2], 6)
    cons.discard("d", params)
    assert wait_until(lambda: not prod._held)
    assert prod.poll() == ([], ["p"]) and not prod.busy and not cons.busy


def test_a_lease_does_not_end_while_its_blocks_are_copied_out():
    prod = TcpConnector(KVTransferConfig("TcpConnector", "kv_producer", kv_port=0, kv_lease_duration=0.05), pool())
    try:
        prod.save("p", {"do_remote_decode": True}, [1, 2], 6)
        prod._reading.add("p")  # as the serving thread marks it around its copy
        time.sleep(0.1)
        assert prod.poll() == ([], [])
        prod._reading.discard("p")
        assert prod.poll() == ([], ["p"])
    finally:
        prod.shutdown()


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        parse_kv_transfer_config('{"kv_connector": "P2pNcclConnector", "kv_role": "kv_both"}')
    with pytest.raises(ValueError, match="kv_role must be one of"):
        parse_kv_transfer_config('{"kv_connector": "TcpConnector", "kv_role": "prefill"}')
    with pytest.raises(ValueError, match="unknown key"):
        parse_kv_transfer_config('{"kv_connector": "TcpConnector", "kv_role": "kv_both", "kv_lease": 3}')
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        parse_kv_transfer_config('{"kv_connector": "TcpConnector", "kv_role": "kv_both", '
                                 '"kv_load_failure_policy": "retry"}')
    with pytest.raises(ValueError, match="--kv-offload-gb"):
        parse_kv_transfer_config('{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}')
    c = parse_kv_transfer_config('{"kv_connector": "TcpConnector", "kv_role": "kv_consumer", '
                                 '"kv_connector_extra_config": {"kv_lease_duration": 5}}')
    assert c.kv_lease_duration == 5 and c.is_consumer and not c.is_producer
    assert parse_kv_transfer_config(None, 0.5).kv_connector == "OffloadingConnector"


def _req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=1), max_total_tokens=1000)


def test_offloaded_prefix_comes_back_from_host_memory_exactly():
    p = pool(num_blocks=4)
    conn = OffloadingConnector(KVTransferConfig("OffloadingConnector", offload_bytes=1 << 20), p)
    kv = KVCacheManager(4, BS, True, host_tier=conn.host_tier)
    first = _req("a", list(range(100, 113)))                 # 3 full blocks + 1 token
    hits, _ = kv.get_computed_blocks(first)
    assert kv.allocate_slots(first, 13, hits)
    first.num_computed_tokens = 13
    kv.cache_full_blocks(first)
    original = blocks_of(p, first.block_ids[:3]).clone()
    kv.free(first)
    other = _req("b", list(range(500, 516)))                 # takes the whole pool: evicts a's blocks
    assert kv.allocate_slots(other, 16, [])
    assert len(conn.host_tier) == 3 and conn.stats.offload_saved_blocks == 3
    for cache in p.caches:                                   # b's step overwrites the blocks
        cache.zero_()
    kv.free(other)
    again = _req("c", list(range(100, 113)))
    hits, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 12 and conn.stats.offload_hit_tokens == 12
    assert kv.allocate_slots(again, 1, hits)
    assert torch.equal(blocks_of(p, again.block_ids[:3]), original)
    kv.free(again)
    assert kv.pool.is_whole()


def test_start_up_refuses_what_cannot_run():
    from types import SimpleNamespace

    from splitserve.engine.config_builder import kv_transfer_config
    tcp = '{"kv_connector": "TcpConnector", "kv_role": "kv_both"}'
    with pytest.raises(ValueError, match="work only for a TcpConnector kv_producer"):
        kv_transfer_config(SimpleNamespace(kv_transfer_config=tcp, kv_offload_gb=None), world_size=2)
    nixl = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_port": 14579}'
    with pytest.raises(ValueError, match="NixlConnector runs one rank per engine"):
        kv_transfer_config(SimpleNamespace(kv_transfer_config=nixl, kv_offload_gb=None), world_size=2)
    assert kv_transfer_config(SimpleNamespace(kv_transfer_config=None, kv_offload_gb=None), 1) is None


@pytest.mark.parametrize("total_heads", [4, 1])  # split over the ranks, or one head replicated on both
def test_tensor_parallel_producer_to_one_rank_reader_maps_heads(total_heads):
    """A TP=2 producer (its core's side channel + one BlockServer per rank, each with its heads)
    read by a one-rank consumer: the blocks arrive with every head where a one-rank pool holds it."""
    import socket

    from splitserve.kv_transfer.pool import KVLayout, LayoutOnly, rank_heads
    from splitserve.kv_transfer.tcp import BlockServer
    with socket.socket() as s:  # a free port; the ranks take the next two (kv_port + 1 + rank)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    full = pool(heads=total_heads, seed=3)
    ranks = [KVPool([c[:, :, :, rank_heads(total_heads, 2, r)].contiguous() for c in full.caches]) for r in range(2)]
    layout = KVLayout(2, ranks[0].layout.num_kv_heads, 8, BS, "float32", tp_size=2, total_kv_heads=total_heads)
    prod = TcpConnector(KVTransferConfig("TcpConnector", "kv_producer", kv_port=port), LayoutOnly(layout))
    servers = [BlockServer(ranks[r], "127.0.0.1", port + 1 + r) for r in range(2)]
    cons = TcpConnector(KVTransferConfig("TcpConnector", "kv_consumer"), pool(heads=total_heads, seed=4))
    try:
        params = prod.save("p", {"do_remote_decode": True}, [6, 2, 9], 12)
        assert params["tp_size"] == 2
        cons.load_async("d", params, [1, 3, 5], 0, 12)
        [done], _ = wait_loads(cons)
        assert done.ok, done.error
        assert torch.equal(blocks_of(cons.pool, [1, 3, 5]), blocks_of(full, [6, 2, 9]))
        assert wait_until(lambda: prod.poll()[1] == ["p"])
        assert prod.stats.sent_tokens == 12 and prod.stats.sent_bytes == cons.stats.recv_bytes
    finally:
        for x in (prod, cons, *servers):
            x.shutdown()


def test_layout_rules_for_other_tensor_parallel_sizes():
    from splitserve.kv_transfer.pool import KVLayout, head_sources
    one = KVLayout(2, 4, 8, 16, "float32")
    assert one.mismatch(KVLayout(2, 2, 8, 16, "float32", tp_size=2, total_kv_heads=4)) is None
    assert "KV heads: local 4, remote 8" in one.mismatch(KVLayout(2, 4, 8, 16, "float32", 2, 8))
    assert "must run on one rank" in KVLayout(2, 2, 8, 16, "float32", 2, 4).mismatch(KVLayout(2, 1, 8, 16, "float32", 4, 4))
    assert "num_kv_heads: local 4, remote 2" in one.mismatch(KVLayout(2, 2, 8, 16, "float32"))
    assert head_sources(4, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert head_sources(2, 4) == [(0, 0), (2, 0)]      # replicated: the first rank holding each head
