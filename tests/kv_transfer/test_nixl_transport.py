"""NixlKVTransport on host memory (skipped where NIXL is not installed): the descriptors a READ costs
after NIXL's merging (one per layer for blocks contiguous on both sides, one per (layer, block) when
scattered, one per block when both pools are block-major), the bytes exact in every pairing of
layouts, a long READ split over UCX worker threads, and layouts NIXL cannot address refused."""
import time

import pytest
import torch

try:
    from splitserve.kv_transfer.nixl_transport import import_nixl
    import_nixl()
except ImportError:
    pytest.skip("NIXL is not installed (pip install 'splitserve[nixl]')", allow_module_level=True)

from splitserve.kv_transfer.nixl_transport import NixlKVTransport, pool_layout  # noqa: E402

LAYERS, BLOCKS, SHAPE = 3, 64, (2, 4, 2, 8)  # a block of a layer: [2, block_size 4, 2 heads, 8]
_names = iter(range(10**6))


def pool(block_major: bool, seed: int, blocks: int = BLOCKS):
    g = torch.Generator().manual_seed(seed)
    if block_major:
        buf = torch.randn(blocks, LAYERS, *SHAPE, generator=g)
        return [buf[:, layer] for layer in range(LAYERS)]
    return [torch.randn(blocks, *SHAPE, generator=g) for _ in range(LAYERS)]


_made: list = []


@pytest.fixture(autouse=True)
def _close_transports():
    """Each test's agents are closed at its end, on this thread (NixlKVTransport.close says why)."""
    yield
    while _made:
        _made.pop().close()


def transport(caches, **kw):
    _made.append(NixlKVTransport(f"t{next(_names)}", caches, telemetry=True, **kw))
    return _made[-1]


def read(reader, peer, remote, local, note=b""):
    h = reader.read(peer, remote, local, note)
    deadline = time.monotonic() + 30
    while (state := reader.state(h)) == "PROC":
        assert time.monotonic() < deadline, "READ never finished"
    tel = reader.telemetry(h)
    reader.release(h)
    assert state == "DONE"
    return tel


def same(dst, local, src, remote) -> bool:
    return all(torch.equal(d[local], s[remote]) for d, s in zip(dst, src))


@pytest.mark.parametrize("src_major,dst_major", [(False, False), (True, True), (True, False), (False, True)])
def test_scattered_and_contiguous_reads_exact_with_the_descriptors_expected(src_major, dst_major):
    src, dst = pool(src_major, 1), pool(dst_major, 2)
    a, b = transport(src), transport(dst)
    assert a.layout.block_major == src_major and b.layout.block_major == dst_major
    peer = b.add_peer(a.metadata())
    by_block = src_major and dst_major
    assert b.descriptors_per_block(peer) == (1 if by_block else LAYERS)
    # Contiguous on both sides: NIXL merges the run (one per layer; one in all, block-major). Mixed
    # layouts go by (layer, block), and a block-major side's blocks of one layer are not adjacent.
    tel = read(b, peer, list(range(10, 20)), list(range(30, 40)))
    assert tel["descriptors"] == (1 if by_block else 10 * LAYERS if src_major or dst_major else LAYERS)
    assert same(dst, list(range(30, 40)), src, list(range(10, 20)))
    # Every other block on the source, backwards on the reader: nothing to merge.
    remote, local = list(range(1, 41, 2)), list(range(63, 43, -1))
    tel = read(b, peer, remote, local)
    assert tel["descriptors"] == len(remote) * (1 if by_block else LAYERS)
    assert tel["bytes"] == len(remote) * LAYERS * src[0][0].numel() * 4
    assert same(dst, local, src, remote)
    fresh = pool(dst_major, 2)  # the reader's other blocks are as they were
    untouched = [i for i in range(BLOCKS) if i not in set(local) | set(range(30, 40))]
    assert all(torch.equal(d[untouched], f[untouched]) for d, f in zip(dst, fresh))


def test_a_long_read_split_over_worker_threads_is_exact_and_notifies():
    """2,048 scattered (layer, block) descriptors with num_threads=2: NIXL posts them in two chunks
    (its split size is 1,024) on two UCX workers; the bytes and the one notification arrive."""
    n = 2048
    src, dst = pool(False, 3, blocks=n), pool(False, 4, blocks=n)
    a, b = transport(src), transport(dst, num_threads=2)
    peer = b.add_peer(a.metadata())
    remote, local = list(range(0, n, 2))[:700], list(range(1, n, 2))[::-1][:700]
    tel = read(b, peer, remote, local, b"req-1")
    assert tel["descriptors"] == 700 * LAYERS
    assert same(dst, local, src, remote)
    notes, deadline = [], time.monotonic() + 10
    while not notes and time.monotonic() < deadline:
        notes += a.notifications()
        time.sleep(0.01)
    assert notes == [b"req-1"]


def test_layouts_nixl_cannot_address_are_refused():
    base = torch.zeros(BLOCKS, LAYERS + 1, *SHAPE)
    with pytest.raises(ValueError, match="back to back"):  # layers interleaved with a gap
        pool_layout([base[:, layer] for layer in range(LAYERS)])
    with pytest.raises(ValueError, match="one shape"):
        pool_layout([torch.zeros(BLOCKS, *SHAPE), torch.zeros(BLOCKS + 1, *SHAPE)])


def test_num_threads_is_read_from_the_extra_config():
    from splitserve.config import parse_kv_transfer_config
    cfg = parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", '
                                   '"kv_connector_extra_config": {"num_threads": 8}}')
    assert cfg.num_threads == 8
    assert parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}').num_threads == 0
    with pytest.raises(ValueError, match="num_threads"):
        parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", '
                                 '"kv_connector_extra_config": {"num_threads": -1}}')
