"""KV blocks: reference counts, an LRU queue of free blocks, and the prefix cache (hash -> block).

A free block keeps its hash and contents until it is handed out again, so a later request with the
same prefix can revive it. Allocation takes the least recently freed block and evicts its hash.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass




@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens a cached block holds, to confirm hash hits
    parent_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}  # block hash -> block
        # Called with a cached block just before its hash and contents are given up (the host tier of
        # kv_transfer/offload.py saves it); None: evicted blocks are simply forgotten.
        self.on_evict = None

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def is_whole(self) -> bool:
        """Every block is free and unreferenced: nothing leaked."""
        return len(self._free) == self.num_blocks and all(b.ref_cnt == 0 for b in self.blocks)

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None
        return block

    # -- mutations -------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on cached blocks (prefix hits), reviving them if they were free."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drops one reference from each block; blocks reaching zero join the LRU tail in the given
        order (callers pass a request's blocks tail-first so its prefix outlives its suffix)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:  # an identical block already cached (computed twice): keep the first
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = block.token_ids = block.parent_hash = None
        self._cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block)
            block.block_hash = block.token_ids = block.parent_hash = None
