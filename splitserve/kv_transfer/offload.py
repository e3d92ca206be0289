"""OffloadingConnector (--kv-offload-gb N): a host-memory level under the prefix cache.

When the pool hands out a free block that still carries a prefix-cache hash, the block's K/V are
copied to host memory first (keyed by the same chained hash, with its parent hash and tokens to
confirm hits); a later request whose prefix misses in the pool but hits here gets fresh blocks filled
from host memory and registered in the prefix cache again, as if it had never been evicted. So a
long multi-turn conversation keeps its prefix when the pool cannot hold it. The host store is an LRU
of whole blocks bounded by its byte budget. Copies run on the engine core's thread, in stream order
with the model's steps (a block is saved before its new owner's step writes it)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from splitserve.kv_transfer.base import KVConnector


class HostBlockStore:
    """The host tier the KV manager talks to: `save` an evicted cached block, `contains` / `load` on a
    prefix miss. Entries: block hash -> (parent hash, token ids, `[layers, 2, block, heads, dim]`)."""

    def __init__(self, pool, capacity_bytes: int, stats) -> None:
        self.pool = pool
        self.stats = stats
        self.capacity = max(0, capacity_bytes // pool.layout.bytes_per_block())
        if self.capacity < 1:
            raise ValueError(f"kv_offload_gb holds no block: a block needs {pool.layout.bytes_per_block()} bytes")
        self._blocks: OrderedDict[int, tuple[int | None, tuple[int, ...], torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def save(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        while len(self._blocks) >= self.capacity:
            self._blocks.popitem(last=False)
        self._blocks[block_hash] = (parent_hash, token_ids, self.pool.read([block_id])[0])
        self.stats.offload_saved_blocks += 1

    def contains(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> bool:
        entry = self._blocks.get(block_hash)
        return entry is not None and entry[0] == parent_hash and entry[1] == token_ids

    def load(self, block_hash: int, block_id: int) -> None:
        _, _, data = self._blocks[block_hash]
        self._blocks.move_to_end(block_hash)
        self.pool.write([block_id], data.unsqueeze(0))
        self.stats.offload_hit_tokens += self.pool.layout.block_size


class OffloadingConnector(KVConnector):
    def __init__(self, config, pool) -> None:
        super().__init__(config, pool)
        self.host_tier = HostBlockStore(pool, config.offload_bytes, self.stats)
