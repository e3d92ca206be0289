"""NIXL under a paged KV pool: the one place splitserve calls NIXL (the `nixl` package from PyPI,
UCX underneath: CUDA IPC or NVLink inside a node, RDMA across nodes, shared memory for host pools).

Each engine registers its KV memory once and prepares its descriptor list once (NIXL's
`prep_xfer_dlist`); a reader prepares each writer's list once, at the handshake. A request's READ is
then `make_prepped_xfer` with index lists into the two prepared lists, with a notification (the
request id) the writer sees when the read is done, so it can free the blocks.

What a descriptor is depends on the pool's layout (the per-layer tensors the runner gives):
- layer-major (each layer its own `[num_blocks, 2, block_size, kv_heads, head_dim]` tensor): one
  descriptor per (layer, block), `block_bytes` long. NIXL merges runs of descriptors adjacent on
  both sides (consecutive blocks in both pools) into one, so a request whose blocks are contiguous
  on both sides costs one descriptor per layer; scattered blocks cost layers x blocks descriptors, and
  UCX posts each one separately (on a GPU ~10 us each: one CUDA IPC copy and event per descriptor,
  84 ms for a 4,096-token Llama-3-8B prompt on every other block);
- block-major (the layers are views into one `[num_blocks, layers, 2, block_size, kv_heads, head_dim]`
  buffer): a block of every layer is one contiguous run, one descriptor per block (32x fewer for a
  32-layer model), when both sides are block-major; otherwise the (layer, block) descriptors above.
`num_threads` > 0 turns on NIXL's multi-threaded UCX engine: a READ of at least 1,024 descriptors is
split into chunks posted in parallel on that many dedicated UCX workers (NIXL's own remedy for long
descriptor lists; vLLM's NixlConnector uses 4).

The two pools must agree on what a block is (dtype, block size, KV heads and head size per layer,
layer count): `add_peer` refuses a mismatch with the difference named, at the handshake.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import numpy as np
import torch


def import_nixl():
    """NIXL's Python agent classes (the package installs as `nixl`, or per CUDA as `nixl_cu12`/`nixl_cu13`)."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            mod = __import__(name, fromlist=["nixl_agent"])
            return mod.nixl_agent, mod.nixl_agent_config
        except ImportError:
            continue
    raise ImportError("the NixlConnector needs NIXL: pip install nixl (or nixl-cu13 / nixl-cu12)")


@dataclass(frozen=True)
class PoolLayout:
    """What a KV block is, which both sides of a transfer must agree on (and how this side lays its
    blocks out, which they need not)."""
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_bytes: int           # one layer's K and V of one block
    block_major: bool = False  # a block of all layers is one contiguous run (see the module's doc)

    @property
    def block_stride(self) -> int:
        """Bytes from one block of a layer to the next block of that layer."""
        return self.block_bytes * (self.num_layers if self.block_major else 1)

    def mismatch(self, other: "PoolLayout") -> str | None:
        diffs = [f"{k}: ours {a}, theirs {b}" for (k, a), b in zip(asdict(self).items(), asdict(other).values())
                 if k not in ("num_blocks", "block_major") and a != b]
        return "; ".join(diffs) or None


def pool_layout(kv_caches: list[torch.Tensor]) -> PoolLayout:
    t = kv_caches[0]
    num_blocks, two, block_size, kv_heads, head_dim = t.shape
    block_bytes = t[0].numel() * t.element_size()
    if two != 2 or any(c.shape != t.shape or c.dtype != t.dtype or c.device != t.device or c.stride() != t.stride()
                       or not c[0].is_contiguous() for c in kv_caches):
        raise ValueError("NIXL needs every layer's KV pool in one shape, dtype and layout, each block contiguous")
    stride = t.stride(0) * t.element_size()
    n = len(kv_caches)
    block_major = n > 1 and stride == n * block_bytes and all(
        c.data_ptr() == t.data_ptr() + i * block_bytes for i, c in enumerate(kv_caches))
    if stride != block_bytes and not block_major:
        raise ValueError(f"NIXL needs a layer's blocks back to back, or the layers of a block back to back "
                         f"(block stride {stride} bytes, a block {block_bytes})")
    return PoolLayout(n, num_blocks, block_size, kv_heads, head_dim, str(t.dtype).removeprefix("torch."),
                      block_bytes, block_major)


def _layer_descriptors(addrs: list[int], layout: PoolLayout, device_id: int) -> np.ndarray:
    """One (address, length, device) row per (layer, block), layer-major: row = layer * num_blocks + block."""
    blocks = np.arange(layout.num_blocks, dtype=np.int64) * layout.block_stride
    rows = np.empty((len(addrs) * layout.num_blocks, 3), dtype=np.int64)
    for layer, base in enumerate(addrs):
        s = slice(layer * layout.num_blocks, (layer + 1) * layout.num_blocks)
        rows[s, 0] = base + blocks
        rows[s, 1] = layout.block_bytes
        rows[s, 2] = device_id
    return rows


def _block_descriptors(addrs: list[int], layout: PoolLayout, device_id: int) -> np.ndarray:
    """A block-major pool: one row per block, all its layers: row = block."""
    rows = np.empty((layout.num_blocks, 3), dtype=np.int64)
    rows[:, 0] = addrs[0] + np.arange(layout.num_blocks, dtype=np.int64) * layout.block_stride
    rows[:, 1] = layout.block_stride
    rows[:, 2] = device_id
    return rows


class NixlKVTransport:
    def __init__(self, name: str, kv_caches: list[torch.Tensor], backends: tuple[str, ...] = ("UCX",),
                 num_threads: int = 0, telemetry: bool = False):
        # UCX reads through CUDA IPC only where it sees NVLink, unless told otherwise: on one GPU (or
        # PCIe-only GPUs) it would fall back to TCP over loopback, ~3,000x slower (BENCHMARKS.md,
        # "KV transfer over NIXL"). UCX reads its environment when the agent creates its context, so
        # this must come first. (Its CUDA transports also need the CUDA runtime on LD_LIBRARY_PATH,
        # which only the launching shell can set: README, "Prefill/decode disaggregation".)
        if kv_caches[0].is_cuda:  # (on host pools UCX would warn about an unused variable)
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        agent_cls, config_cls = import_nixl()
        self.name = name
        self.layout = lay = pool_layout(kv_caches)
        self.mem_type = "VRAM" if kv_caches[0].is_cuda else "DRAM"
        self.device_id = (kv_caches[0].device.index or 0) if kv_caches[0].is_cuda else 0
        self.agent = agent_cls(name, config_cls(backends=list(backends), num_threads=num_threads,
                                                capture_telemetry=telemetry))
        self._kv = kv_caches  # keep the registered memory alive
        self.addrs = [t.data_ptr() for t in kv_caches]
        # One region per layer, or the one buffer of a block-major pool.
        regions = [(self.addrs[0], lay.num_blocks * lay.num_layers * lay.block_bytes)] if lay.block_major else \
            [(a, lay.num_blocks * lay.block_bytes) for a in self.addrs]
        self._registered = self.agent.register_memory([(a, n, self.device_id, "") for a, n in regions], self.mem_type)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _layer_descriptors(self.addrs, lay, self.device_id),
                                                 self.mem_type)
        self._local_blocks = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _block_descriptors(self.addrs, lay, self.device_id), self.mem_type) \
            if lay.block_major else None
        self._peers: dict[str, tuple[object, PoolLayout, bool]] = {}  # name -> (prepared list, layout, by block)

    def metadata(self) -> dict:
        """What a peer needs to read from us (plain data: msgpack/JSON-able but for the agent bytes)."""
        return {"name": self.name, "agent": self.agent.get_agent_metadata(), "layout": asdict(self.layout),
                "addrs": self.addrs, "device_id": self.device_id, "mem_type": self.mem_type}

    def add_peer(self, meta: dict) -> str:
        layout = PoolLayout(**meta["layout"])
        diff = self.layout.mismatch(layout)
        if diff:
            raise ValueError(f"KV pools of {self.name} and {meta['name']} differ ({diff}); "
                             "the two instances must run the same model with the same --kv-cache-dtype and --block-size")
        peer = self.agent.add_remote_agent(meta["agent"])
        peer = peer.decode() if isinstance(peer, bytes) else peer
        by_block = self.layout.block_major and layout.block_major
        rows = (_block_descriptors if by_block else _layer_descriptors)(meta["addrs"], layout, meta["device_id"])
        self._peers[peer] = (self.agent.prep_xfer_dlist(peer, rows, meta["mem_type"]), layout, by_block)
        return peer

    def descriptors_per_block(self, peer: str) -> int:
        """How many descriptors a scattered block costs a READ from this peer (1 or the layer count)."""
        return 1 if self._peers[peer][2] else self.layout.num_layers

    def _indices(self, block_ids: list[int], num_blocks: int) -> np.ndarray:
        b = np.asarray(block_ids, dtype=np.int64)
        return (np.arange(self.layout.num_layers, dtype=np.int64)[:, None] * num_blocks + b[None, :]).ravel().astype(np.int32)

    def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], notif: bytes = b""):
        """Starts reading the peer's blocks into ours (every layer); returns the handle to poll."""
        assert len(remote_block_ids) == len(local_block_ids)
        remote, layout, by_block = self._peers[peer]
        if by_block:
            handle = self.agent.make_prepped_xfer("READ", self._local_blocks, np.asarray(local_block_ids, dtype=np.int32),
                                                  remote, np.asarray(remote_block_ids, dtype=np.int32), notif)
        else:
            handle = self.agent.make_prepped_xfer("READ", self._local, self._indices(local_block_ids, self.layout.num_blocks),
                                                  remote, self._indices(remote_block_ids, layout.num_blocks), notif)
        state = self.agent.transfer(handle)
        if state == "ERR":
            handle.release()
            raise RuntimeError(f"NIXL could not start reading from {peer}")
        return handle

    def state(self, handle) -> str:
        """"DONE", "PROC" or "ERR" (a failed transfer: the peer is gone, say)."""
        return self.agent.check_xfer_state(handle)

    def telemetry(self, handle) -> dict:
        """A finished transfer's NIXL telemetry (with `telemetry=True`): microseconds posting it and
        moving it, and the descriptors it took after NIXL's merging."""
        t = self.agent.get_xfer_telemetry(handle)
        return {"post_us": t.postDuration, "xfer_us": t.xferDuration, "descriptors": t.descCount, "bytes": t.totalBytes}

    def release(self, handle) -> None:
        handle.release()

    def notifications(self) -> list[bytes]:
        """Notes peers attached to reads of our blocks that have finished (request ids)."""
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def close(self) -> None:
        """Releases every NIXL object now, on the calling thread, with no transfer in flight. Left to the
        garbage collector, an agent is destroyed on whatever thread runs it, at any time: UCX aborts the
        process when that races with another agent's calls, or at interpreter exit."""
        for peer in list(self._peers):
            self.remove_peer(peer)
        for handle in (self._local, self._local_blocks):
            if handle is not None:
                handle.release()
        self.agent.deregister_memory(self._registered)
        self.agent = None  # the last reference: the C++ agent (its UCX workers, threads) goes here

    def remove_peer(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is not None:
            entry[0].release()
            self.agent.remove_remote_agent(peer)
