"""The prefix cache's block hash, shared by the engine core (core/block_pool.py: which blocks are cached)
and the front (engine/replica_router.py: which data-parallel replica holds a prompt's first blocks),
so the two agree on what "the same prefix" is without the front importing the core."""
from __future__ import annotations


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra: tuple = ()) -> int:
    """Chained block hash: equal only if the whole prefix up to and including this block is equal
    (with overwhelming probability; hits are confirmed against the stored tokens anyway)."""
    return hash((parent_hash, token_ids, extra))
