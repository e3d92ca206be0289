"""NIXL under a paged KV pool: the one place splitserve calls NIXL (the `nixl` package from PyPI,
UCX underneath: CUDA IPC or NVLink inside a node, RDMA across nodes, shared memory for host pools).

Each engine registers its per-layer KV tensors once. A block of a layer is one descriptor: the pools
are `[num_blocks, 2, block_size, kv_heads, head_dim]` per layer, so a block's K and V of one layer
are contiguous bytes (`block_bytes`), and a request's blocks are addressed as (layer, block) pairs.
The reader (the decode side) prepares the writer's descriptor list once per peer and issues one
READ per request: all layers of the request's blocks, from the peer's block ids into its own,
with a notification (the request id) the writer sees when the read is done, so it can free them.

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
    """What a KV block is, which both sides of a transfer must agree on."""
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_bytes: int

    def mismatch(self, other: "PoolLayout") -> str | None:
        diffs = [f"{k}: ours {a}, theirs {b}" for (k, a), b in zip(asdict(self).items(), asdict(other).values())
                 if k != "num_blocks" and a != b]
        return "; ".join(diffs) or None


def pool_layout(kv_caches: list[torch.Tensor]) -> PoolLayout:
    t = kv_caches[0]
    num_blocks, two, block_size, kv_heads, head_dim = t.shape
    assert two == 2 and all(c.shape == t.shape and c.dtype == t.dtype and c.is_contiguous() for c in kv_caches)
    return PoolLayout(len(kv_caches), num_blocks, block_size, kv_heads, head_dim,
                      str(t.dtype).removeprefix("torch."), t[0].numel() * t.element_size())


def _descriptors(addrs: list[int], layout: PoolLayout, device_id: int) -> np.ndarray:
    """One (address, length, device) row per (layer, block), layer-major."""
    blocks = np.arange(layout.num_blocks, dtype=np.int64) * layout.block_bytes
    rows = np.empty((len(addrs) * layout.num_blocks, 3), dtype=np.int64)
    for layer, base in enumerate(addrs):
        s = slice(layer * layout.num_blocks, (layer + 1) * layout.num_blocks)
        rows[s, 0] = base + blocks
        rows[s, 1] = layout.block_bytes
        rows[s, 2] = device_id
    return rows


class NixlKVTransport:
    def __init__(self, name: str, kv_caches: list[torch.Tensor], backends: tuple[str, ...] = ("UCX",)):
        # UCX reads through CUDA IPC only where it sees NVLink, unless told otherwise: on one GPU (or
        # PCIe-only GPUs) it would fall back to TCP over loopback, ~3,000x slower (BENCHMARKS.md,
        # "KV transfer over NIXL"). UCX reads its environment when the agent creates its context, so
        # this must come first. (Its CUDA transports also need the CUDA runtime on LD_LIBRARY_PATH,
        # which only the launching shell can set: README, "Prefill/decode disaggregation".)
        if kv_caches[0].is_cuda:  # (on host pools UCX would warn about an unused variable)
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        agent_cls, config_cls = import_nixl()
        self.name = name
        self.layout = pool_layout(kv_caches)
        self.mem_type = "VRAM" if kv_caches[0].is_cuda else "DRAM"
        self.device_id = (kv_caches[0].device.index or 0) if kv_caches[0].is_cuda else 0
        self.agent = agent_cls(name, config_cls(backends=list(backends)))
        self._kv = kv_caches  # keep the registered memory alive
        self.addrs = [t.data_ptr() for t in kv_caches]
        size = self.layout.num_blocks * self.layout.block_bytes
        self.agent.register_memory([(a, size, self.device_id, "") for a in self.addrs], self.mem_type)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descriptors(self.addrs, self.layout, self.device_id),
                                                 self.mem_type)
        self._peers: dict[str, tuple[object, PoolLayout]] = {}

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
        remote = self.agent.prep_xfer_dlist(peer, _descriptors(meta["addrs"], layout, meta["device_id"]), meta["mem_type"])
        self._peers[peer] = (remote, layout)
        return peer

    def _indices(self, block_ids: list[int], num_blocks: int) -> np.ndarray:
        b = np.asarray(block_ids, dtype=np.int64)
        return (np.arange(self.layout.num_layers, dtype=np.int64)[:, None] * num_blocks + b[None, :]).ravel().astype(np.int32)

    def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], notif: bytes = b""):
        """Starts reading the peer's blocks into ours (every layer); returns the handle to poll."""
        assert len(remote_block_ids) == len(local_block_ids)
        remote, layout = self._peers[peer]
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

    def release(self, handle) -> None:
        handle.release()

    def notifications(self) -> list[bytes]:
        """Notes peers attached to reads of our blocks that have finished (request ids)."""
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def remove_peer(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is not None:
            entry[0].release()
            self.agent.remove_remote_agent(peer)
