"""The only owner of block ids: prefix match, slot allocation, caching of filled blocks, and free.

Sliding windows: when every attention layer of the model has a window (`sliding_window`: the largest
of them; None when any layer attends over the whole context), a query at position p reads no key
before p - W + 1, so a block wholly before the next query's window is never read again by this
request, and it goes back to the pool as the sequence advances (at its next allocate_slots). Its
position in the request's block list becomes None (vLLM puts a null block there): the request's
block table keeps its positions, the worker's copy keeps a stale id there that no kernel reads (see
attention/backend.py), and the request can never register that position in the prefix cache again
(the block may be another request's by then). A passed block that was registered keeps its hash
while it sits free, so later requests with the same prefix can still revive it. Freeing a passed
block at scheduling time is safe although an earlier launched step may still read it: steps run
in order on the device, so that read is done before any later step writes the block for its new
owner.

Encoder-decoder models keep a second group per request: the cross-attention K/V of its encoder
output, `num_blocks_for(request.num_encoder_tokens)` blocks from the same pool, allocated when the
request is admitted (`allocate_encoder`, after its decoder's blocks) and freed with it (`free`: finished, aborted or preempted).
They are never registered in the prefix cache (a request's own encoder fills them); the decoder's
blocks carry the encoder input's identity in their hashes, so decoder blocks are shared only between
requests with the same encoder input.

KV transfer (kv_transfer/): a producer's finished request can `hold` its blocks for a remote reader
(they stay referenced under its id, outside any request, until `free_held`); with a host tier (the
OffloadingConnector) cached blocks are saved to host memory as the pool evicts them, and a prefix
miss in the pool that hits the host tier gets fresh blocks filled from it (`get_computed_blocks`).
"""
from __future__ import annotations

from splitserve.core.block_pool import BlockPool, KVBlock
from splitserve.protocol.block_hash import hash_block
from splitserve.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, host_tier=None):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # request id -> its blocks, in position order; None where the window has passed (freed)
        self._blocks: dict[str, list[KVBlock | None]] = {}
        self._num_passed: dict[str, int] = {}  # request id -> leading blocks freed by the window
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already offered to the cache
        self._encoder_blocks: dict[str, list[KVBlock]] = {}  # request id -> its cross-attention blocks
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0     # of those, tokens found
        self._held: dict[str, list[KVBlock]] = {}  # request id -> blocks kept for a remote reader
        self.host_tier = host_tier  # kv_transfer.offload.HostBlockStore, or None
        if host_tier is not None:
            self.pool.on_evict = lambda b: host_tier.save(b.block_id, b.block_hash, b.parent_hash, b.token_ids)

    @staticmethod
    def _extra_keys(request: Request, start: int, end: int) -> tuple:
        """Extra hash keys of tokens [start, end): the request's LoRA adapter id (two adapters never
        share a block) and the hashes of the images whose placeholders overlap them (none for text),
        so a cached block is reused only for the same adapter and image."""
        lora = (request.lora_request.lora_int_id,) if request.lora_request is not None else ()
        if request.num_encoder_tokens:  # cross-attention makes every decoder block depend on the encoder input
            return lora + (request.encoder_hash,)
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
        compute: the step must produce logits for the last token. A request that asks for
        prompt logprobs gets no hits (as in vLLM): they come from computing every prompt token."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
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
        if self.host_tier is not None and len(hits) < max_blocks:
            hits += self._restore_from_host(request, hits, max_blocks)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * bs
        return hits, len(hits) * bs

    def _restore_from_host(self, request: Request, hits: list[KVBlock], max_blocks: int) -> list[KVBlock]:
        """The blocks after `hits` that the host tier has, in fresh pool blocks filled from it and
        registered in the prefix cache (left unreferenced, like any cached free block: the caller's
        allocate_slots takes them as hits). Stops at the first miss or when the pool has no block."""
        bs, tier = self.block_size, self.host_tier
        found = []
        parent = request.block_hashes[len(hits) - 1] if hits else None
        for i in range(len(hits), max_blocks):
            h, tokens = request.block_hashes[i], tuple(request.token_slice(i * bs, (i + 1) * bs))
            if not tier.contains(h, parent, tokens):
                break
            found.append((h, parent, tokens))
            parent = h
        self.pool.touch(hits)  # the pool hits must survive the allocation below (it evicts LRU blocks)
        found = found[:self.pool.num_free_blocks]
        new = self.pool.allocate(len(found))
        for block, (h, parent, tokens) in zip(new, found):
            tier.load(h, block.block_id)
            self.pool.cache_block(block, h, parent, tokens)
        self.pool.free(list(reversed(hits + new)))  # unreferenced again, the prefix last to go
        return new

    def hold(self, request: Request) -> list[int]:
        """Keeps a finished request's blocks referenced for a remote reader; returns their ids. The
        request itself lets go of them (its state is dropped as by `free`)."""
        self.free_encoder(request)
        blocks = self._blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self._num_passed.pop(request.request_id, None)
        if any(b is None for b in blocks):  # a window freed some: nothing whole to hand over
            self.pool.free([b for b in reversed(blocks) if b is not None])
            request.block_ids = []
            return []
        if request.request_id in self._held:
            raise RuntimeError(f"request {request.request_id!r} already holds blocks for a reader")
        self._held[request.request_id] = blocks
        request.block_ids = []
        return [b.block_id for b in blocks]

    def free_held(self, request_id: str) -> bool:
        """Gives back the blocks held for a reader (acknowledged, or its lease ended)."""
        blocks = self._held.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(list(reversed(blocks)))
        return True

    @property
    def num_held(self) -> int:
        return len(self._held)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Makes room for num_new_tokens beyond request.num_computed_tokens (plus the prefix hits given
        for a newly admitted request). Returns False if blocks run out, changing nothing but the
        freeing of blocks the window has passed (which holds whatever this request does next)."""
        if not computed_blocks:
            self._free_passed_blocks(request, request.num_computed_tokens)  # before: they may serve now
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
        if computed_blocks:
            self._free_passed_blocks(request, num_computed)  # prefix hits the window has already passed
        return True

    def _free_passed_blocks(self, request: Request, num_computed: int) -> None:
        """Frees the request's leading blocks wholly before the window of a query at position
        num_computed (its next token to compute): positions < num_computed - W + 1."""
        if self.sliding_window is None:
            return
        rid = request.request_id
        blocks = self._blocks.get(rid)
        done = self._num_passed.get(rid, 0)
        n = min(max(0, num_computed - self.sliding_window + 1) // self.block_size, len(blocks or ()))
        if n <= done:
            return
        self.cache_full_blocks(request)  # offer the filled ones to the prefix cache before letting go
        passed = blocks[done:n]
        blocks[done:n] = [None] * (n - done)
        self.pool.free(passed)  # oldest first: the LRU evicts them before the request's later blocks
        self._num_passed[rid] = n

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
            if blocks[i] is not None and blocks[i].block_hash is None:  # None: freed by the window
                parent = request.block_hashes[i - 1] if i else None
                self.pool.cache_block(blocks[i], request.block_hashes[i], parent,
                                      tuple(request.token_slice(i * bs, (i + 1) * bs)))
        self._num_registered[request.request_id] = max(num_full, self._num_registered.get(request.request_id, 0))

    def allocate_encoder(self, request: Request) -> bool:
        """Allocates the request's cross-attention blocks. False, changing nothing, if they do not fit.
        Call after its decoder's allocate_slots: that takes its prefix hits out of the free queue,
        where this allocation could otherwise evict and reuse them."""
        n = self.num_blocks_for(request.num_encoder_tokens)
        if request.request_id in self._encoder_blocks:
            raise RuntimeError(f"request {request.request_id!r} already holds its encoder blocks")
        if n > self.pool.num_free_blocks:
            return False
        blocks = self.pool.allocate(n)
        self._encoder_blocks[request.request_id] = blocks
        request.encoder_block_ids = [b.block_id for b in blocks]
        return True

    def free_encoder(self, request: Request) -> None:
        blocks = self._encoder_blocks.pop(request.request_id, [])
        self.pool.free(list(reversed(blocks)))
        request.encoder_block_ids = []

    def free(self, request: Request) -> None:
        """Frees both of the request's groups (decoder blocks and cross-attention blocks)."""
        self.free_encoder(request)
        blocks = self._blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self._num_passed.pop(request.request_id, None)
        self.pool.free([b for b in reversed(blocks) if b is not None])
        request.block_ids = []

    def usage(self) -> float:
        return self.pool.usage()

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
