"""NixlConnector between two pools over NIXL in host memory (UCX shared memory / TCP; skipped where
NIXL is not installed): the bytes that arrive are the producer's, the reader's notification frees
the held blocks, the lease frees unread ones, another layout is refused at the handshake, and a
producer that dies mid-transfer is a failed load, never a hang."""
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from splitserve.config import KVTransferConfig
from splitserve.kv_transfer.pool import KVPool

try:
    from splitserve.kv_transfer.nixl_transport import import_nixl
    import_nixl()
except ImportError:
    pytest.skip("NIXL is not installed (pip install 'splitserve[nixl]')", allow_module_level=True)

from splitserve.kv_transfer.nixl import NixlConnector  # noqa: E402

from tests.kv_transfer.test_connectors import BS, blocks_of, pool  # noqa: E402  (the same small pools)


def poll_until(conns, check, timeout=10.0):
    """Polls every connector (as each engine core does) until check(loads, released) is true."""
    loads, released = [], []
    deadline = time.monotonic() + timeout
    while not check(loads, released):
        if time.monotonic() > deadline:
            break
        for c in conns:
            d, r = c.poll()
            loads += d
            released += r
        time.sleep(0.005)
    return loads, released


def producer(**kw):
    return NixlConnector(KVTransferConfig("NixlConnector", "kv_producer", kv_port=0, **kw), pool(seed=1))


def consumer(p=None, **kw):
    return NixlConnector(KVTransferConfig("NixlConnector", "kv_consumer", **kw), p or pool(seed=2))


def test_read_bytes_exact_and_notification_releases():
    prod, cons = producer(), consumer(kv_load_timeout=5)
    try:
        params = prod.save("p1", {"do_remote_decode": True}, [5, 9, 3, 7], num_prompt_tokens=10)
        assert params["remote_block_ids"] == [5, 9, 3] and params["remote_request_id"] == "p1"
        assert cons.lookup("d1", params, 10, 1) == 2
        cons.load_async("d1", params, [0, 11, 12], first_block=1, num_prompt_tokens=10)
        before0 = blocks_of(cons.pool, [0]).clone()
        loads, released = poll_until([cons, prod], lambda l, r: l and r)
        assert [(d.request_id, d.ok, d.num_tokens) for d in loads] == [("d1", True, 10)]
        assert released == ["p1"]  # the reader's notification, not the lease (30 s)
        assert torch.equal(blocks_of(cons.pool, [11, 12]), blocks_of(prod.pool, [9, 3]))
        assert torch.equal(blocks_of(cons.pool, [0]), before0)  # the local hit was not overwritten
        assert not prod.busy and not cons.busy
        assert cons.stats.recv_tokens == 6 and cons.stats.recv_bytes == 2 * 2 * 2 * BS * 2 * 8 * 4
        # A second load from the same producer reuses the handshake (the READ is posted at once).
        params = prod.save("p2", {"do_remote_decode": True}, [1, 2], num_prompt_tokens=8)
        cons.load_async("d2", params, [13, 14], 0, 8)
        loads, released = poll_until([cons, prod], lambda l, r: l and r)
        assert loads[0].ok and released == ["p2"] and cons.handshakes == 1
        assert torch.equal(blocks_of(cons.pool, [13, 14]), blocks_of(prod.pool, [1, 2]))
    finally:
        prod.shutdown()
        cons.shutdown()


def test_unread_blocks_go_back_at_lease_end():
    prod = producer(kv_lease_duration=0.2)
    try:
        prod.save("p", {"do_remote_decode": True}, [1, 2], 6)
        assert prod.poll() == ([], []) and prod.busy
        time.sleep(0.3)
        assert prod.poll() == ([], ["p"]) and not prod.busy
    finally:
        prod.shutdown()


@pytest.mark.parametrize("other", [dict(block_size=8), dict(dtype=torch.bfloat16), dict(layers=3)])
def test_layout_mismatch_is_refused_at_the_handshake(other):
    prod = NixlConnector(KVTransferConfig("NixlConnector", "kv_producer", kv_port=0), pool(**other))
    cons = consumer()
    try:
        params = prod.save("p", {"do_remote_decode": True}, [1], 3)
        cons.load_async("d", params, [2], 0, 3)
        [done], _ = poll_until([cons], lambda l, r: l)
        assert not done.ok and not done.recoverable and "handshake" in done.error and "refused" in done.error
        key = next(iter(other))
        assert (key if key != "layers" else "num_layers") in done.error
        assert not cons.busy and prod._held  # nothing was read
    finally:
        prod.shutdown()
        cons.shutdown()


def test_tcp_reader_is_told_the_producer_speaks_nixl():
    from splitserve.kv_transfer.tcp import TcpConnector
    prod = producer()
    cons = TcpConnector(KVTransferConfig("TcpConnector", "kv_consumer", kv_load_timeout=2), pool(seed=2))
    try:
        params = prod.save("p", {"do_remote_decode": True}, [1], 3)
        cons.load_async("d", params, [2], 0, 3)
        [done], _ = poll_until([cons], lambda l, r: l)
        assert not done.ok and "NixlConnector" in done.error
    finally:
        prod.shutdown()
        cons.shutdown()


def test_unreachable_producer_fails_within_the_timeout():
    cons = consumer(kv_load_timeout=0.5)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": [0],
              "remote_request_id": "x", "remote_engine_id": "gone"}
    try:
        t = time.monotonic()
        cons.load_async("d", params, [4], 0, 3)
        [done], _ = poll_until([cons], lambda l, r: l)
        assert not done.ok and done.recoverable and "did not answer" in done.error
        assert time.monotonic() - t < 5 and cons.stats.failed == 1 and not cons.busy
    finally:
        cons.shutdown()


def test_cancel_drops_the_load():
    prod, cons = producer(), consumer()
    try:
        params = prod.save("p", {"do_remote_decode": True}, [1, 2], 8)
        cons.load_async("d", params, [3, 4], 0, 8)
        cons.cancel("d")  # before the handshake came back
        loads, _ = poll_until([cons], lambda l, r: False, timeout=1.0)
        assert loads == [] and not cons.busy
    finally:
        prod.shutdown()
        cons.shutdown()


N_BIG = 4096


def _serve_then_die(port_q, go_q):
    """A producer in its own process with a large pool; it holds blocks, then dies when told."""
    big = KVPool([torch.randn(N_BIG, 2, 16, 2, 16) for _ in range(8)])
    prod = NixlConnector(KVTransferConfig("NixlConnector", "kv_producer", kv_port=0), big)
    # Blocks in reverse order: NIXL cannot merge them, one descriptor each (a READ of ~10 ms or more).
    port_q.put(prod.save("p", {"do_remote_decode": True}, list(range(N_BIG))[::-1], N_BIG * 16))
    go_q.get()
    os.kill(os.getpid(), signal.SIGKILL)


def test_producer_killed_mid_transfer_fails_the_load():
    ctx = mp.get_context("spawn")
    port_q, go_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_serve_then_die, args=(port_q, go_q), daemon=True)
    proc.start()
    cons = None
    try:
        params = port_q.get(timeout=60)
        # A first, small load makes the handshake, so the big one below is a READ in flight.
        cons = consumer(KVPool([torch.zeros(N_BIG, 2, 16, 2, 16) for _ in range(8)]), kv_load_timeout=3)
        cons.load_async("warm", dict(params, remote_block_ids=[0]), [0], 0, 16)
        [warm], _ = poll_until([cons], lambda l, r: l)
        assert warm.ok
        go_q.put("die")  # it dies about as the READ starts: before, during or just after it
        time.sleep(0.002)
        cons.load_async("d", params, list(range(N_BIG)), 0, N_BIG * 16)
        proc.join(30)
        t = time.monotonic()
        loads, _ = poll_until([cons], lambda l, r: l, timeout=20)
        assert len(loads) == 1 and time.monotonic() - t < 10
        # The READ may have finished before the kill; if not, the load failed (recoverable): NIXL
        # refused to start it (the peer is gone) or reported ERR.
        assert loads[0].ok or (loads[0].recoverable and "KV " in loads[0].error)
        # A load after the death never hangs: it fails within the timeout.
        cons.load_async("d2", dict(params, remote_block_ids=[1]), [1], 0, 16)
        [late], _ = poll_until([cons], lambda l, r: l, timeout=20)
        assert not late.ok and late.recoverable
        assert not cons.busy
    finally:
        if cons is not None:
            cons.shutdown()
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def test_start_up_takes_one_rank_nixl_and_refuses_a_layout_only_pool():
    from types import SimpleNamespace

    from splitserve.engine.config_builder import kv_transfer_config
    from splitserve.kv_transfer.pool import KVLayout, LayoutOnly
    cfg = kv_transfer_config(SimpleNamespace(kv_transfer_config='{"kv_connector": "NixlConnector", '
                                                                 '"kv_role": "kv_consumer"}', kv_offload_gb=None), 1)
    assert cfg.kv_connector == "NixlConnector"
    with pytest.raises(ValueError, match="one rank per engine"):
        NixlConnector(cfg, LayoutOnly(KVLayout(2, 1, 8, BS, "float32", 2, 2)))


def test_a_slow_read_does_not_stall_the_core_thread():
    """A READ of scattered blocks (one descriptor each: NIXL spends ~10 us per descriptor posting it)
    runs on the connector's NIXL thread: load_async and poll stay short while it goes on."""
    n = 2048
    big = lambda seed: KVPool([torch.randn(n, 2, 16, 2, 16, generator=torch.Generator().manual_seed(seed))
                               for _ in range(8)])
    prod = NixlConnector(KVTransferConfig("NixlConnector", "kv_producer", kv_port=0), big(1))
    cons = consumer(big(2))
    try:
        params = prod.save("p", {"do_remote_decode": True}, list(range(n))[::-1], n * 16)
        cons.load_async("warm", dict(params, remote_block_ids=[0]), [0], 0, 16)  # the handshake
        assert poll_until([cons], lambda l, r: l)[0][0].ok
        t = time.perf_counter()
        cons.load_async("d", params, list(range(n)), 0, n * 16)
        slowest = time.perf_counter() - t
        loads, deadline = [], time.monotonic() + 20
        while not loads and time.monotonic() < deadline:
            t = time.perf_counter()
            loads += cons.poll()[0]
            slowest = max(slowest, time.perf_counter() - t)
            time.sleep(0.001)
        assert loads and loads[0].ok
        assert torch.equal(blocks_of(cons.pool, list(range(n))), blocks_of(prod.pool, list(range(n))[::-1]))
        assert slowest < 0.02, slowest
    finally:
        prod.shutdown()
        cons.shutdown()
