"""The only owner of block ids: prefix match, slot allocation, caching of filled blocks, and free."""
from __future__ import annotations

from splitserve.core.block_pool import BlockPool, KVBlock, hash_block
from splitserve.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}  # request id -> its blocks, in position order
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already offered to the cache
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0     # of those, tokens found

    @staticmethod
    def _extra_keys(request: Request, start: int, end: int) -> tuple:
        """Extra hash keys of tokens [start, end): the request's LoRA adapter id (two adapters never
        share a block) and the hashes of the images whose placeholders overlap them (none for text),
        so a cached block is reused only for the same adapter and image."""
        lora = (request.lora_request.lora_int_id,) if request.lora_request is not None else ()
        if not request.mm_items:
            return lora
        return lora + tuple(item.hash for item in request.mm_items if item.offset < end and item.end > start)

    def _update_block_hashes(self, request: Request, upto_tokens: int) -> None:
        """Extends request.block_hashes over every full block within the first upto_tokens tokens."""
        bs = self.block_size
        for i in range(len(request.block_hashes), upto_tokens // bs):
            parent = request.block_hashes[-1] if request.block_hashes else None
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            request.block_hashes.append(hash_block(parent, tokens, self._extra_keys(request, i * bs, (i + 1) * bs)))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, in whole blocks. At least one token is always left to
        compute: the step must produce logits for the last token."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        self._update_block_hashes(request, max_blocks * bs)
        hits: list[KVBlock] = []
        parent = None
        for i in range(max_blocks):
            h = request.block_hashes[i]
            block = self.pool.lookup(h, parent, tuple(request.token_slice(i * bs, (i + 1) * bs)))
            if block is None:
                break
            hits.append(block)
            parent = h
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * bs
        return hits, len(hits) * bs

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Makes room for num_new_tokens beyond request.num_computed_tokens (plus the prefix hits given
        for a newly admitted request). Returns False, changing nothing, if blocks run out."""
        blocks = self._blocks.get(request.request_id, ())
        if not computed_blocks and request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
            return True  # the common decode case: the last block still has room
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(blocks) - len(computed_blocks)
        # Prefix hits that sit free in the pool count against the free blocks they would revive.
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - revived:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
        new = computed_blocks + self.pool.allocate(needed) if needed > 0 else computed_blocks
        # Appended in place: a growing request costs O(new blocks), and the scheduler sends the worker
        # only what was appended since its last message.
        self._blocks.setdefault(request.request_id, []).extend(new)
        request.block_ids.extend(b.block_id for b in new)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's blocks that are now completely computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens, request.num_known_tokens) // bs
        if num_full <= self._num_registered.get(request.request_id, 0):
            return  # no block filled up since the last call
        self._update_block_hashes(request, num_full * bs)
        blocks = self._blocks.get(request.request_id, [])
        for i in range(self._num_registered.get(request.request_id, 0), num_full):
            if blocks[i].block_hash is None:
                parent = request.block_hashes[i - 1] if i else None
                self.pool.cache_block(blocks[i], request.block_hashes[i], parent,
                                      tuple(request.token_slice(i * bs, (i + 1) * bs)))
        self._num_registered[request.request_id] = max(num_full, self._num_registered.get(request.request_id, 0))

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))
        request.block_ids = []

    def usage(self) -> float:
        return self.pool.usage()

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
