"""The contract between the engine core and a KV connector (DESIGN.md, "KV transfer").

Scheduler side (the engine core calls these on its own thread, with plain data):
- `lookup(request_id, params, num_prompt_tokens, num_local_blocks)`: how many of the request's prompt
  blocks, after the `num_local_blocks` it found in its own prefix cache, exist remotely (0: none).
- `load_async(request_id, params, block_ids, first_block, num_prompt_tokens)`: starts bringing those
  blocks into the request's local blocks `block_ids[first_block:]`; the request waits in the receiving state
  (WAITING_FOR_REMOTE_KVS) and blocks no one.
- `poll()`: which loads finished (ok or failed, with why) and which held requests' blocks may be
  freed (the reader acknowledged, or the lease ran out). Finished loads land in the pool here, on
  the core's thread, so they are ordered with the model's steps.
- `cancel(request_id)`: the receiving request was aborted; its load's data is dropped.
- `discard(request_id, params)`: a request with remote blocks will not read them (aborted before its
  load began, or its own prefix cache had them): the producer is told to free them (best effort; the
  lease covers a lost message).
- `save(request_id, params, block_ids, num_prompt_tokens)`: a request finished prefill on a producer;
  returns the `kv_transfer_params` a decode engine needs (vLLM's fields) when the connector holds the
  blocks for a remote reader, in which case the core keeps them until `poll` releases them.
- `release(request_id)`: forget a held request now (shutdown, or the core freed it).

Worker side: the connector reads and writes whole blocks of the paged pool through `pool.KVPool`.
A NIXL connector fits the same calls: `load_async` posts a READ of remote descriptors into local
ones, `poll` checks the transfer handles, `save` registers nothing (the pool is registered once) and
returns the agent's address; the reader's notification is the acknowledgement.

`host_tier` (OffloadingConnector): a second, host-memory level of the prefix cache the KV manager
asks on a prefix miss and hands evicted blocks to (offload.py)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Upper bounds (s) of the transfer-time histogram's buckets (Prometheus' "le"), then +Inf.
TRANSFER_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class LoadDone:
    request_id: str
    ok: bool
    num_tokens: int = 0   # prompt tokens whose K/V are now in the request's blocks (from position 0)
    error: str | None = None
    recoverable: bool = True  # False: recomputing would hide a misconfiguration (a layout mismatch)


@dataclass
class KVTransferStats:
    """Running totals (the metrics read them as counters and one histogram)."""
    sent_tokens: int = 0
    sent_bytes: int = 0
    recv_tokens: int = 0
    recv_bytes: int = 0
    failed: int = 0
    time_buckets: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_TIME_BUCKETS) + 1))
    time_sum: float = 0.0
    offload_saved_blocks: int = 0
    offload_hit_tokens: int = 0

    def observe_time(self, seconds: float) -> None:
        self.time_buckets[bisect.bisect_left(TRANSFER_TIME_BUCKETS, seconds)] += 1
        self.time_sum += seconds


class KVConnector:
    """Base: a connector that moves nothing (every call a no-op). Subclasses override what they do."""
    host_tier = None

    def __init__(self, config, pool) -> None:
        self.config = config  # config.KVTransferConfig
        self.pool = pool      # pool.KVPool over this engine's KV tensors
        self.stats = KVTransferStats()

    # -- scheduler side ------------------------------------------------------------------------
    def lookup(self, request_id: str, params: dict | None, num_prompt_tokens: int, num_local_blocks: int) -> int:
        return 0

    def load_async(self, request_id: str, params: dict, block_ids: list[int], first_block: int,
                   num_prompt_tokens: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} loads nothing from remote engines")

    def poll(self) -> tuple[list[LoadDone], list[str]]:
        return [], []

    def cancel(self, request_id: str) -> None:
        pass

    def discard(self, request_id: str, params: dict) -> None:
        pass

    def save(self, request_id: str, params: dict | None, block_ids: list[int], num_prompt_tokens: int) -> dict | None:
        return None

    def release(self, request_id: str) -> None:
        pass

    @property
    def busy(self) -> bool:
        """Loads in flight or blocks held: the core keeps polling even with nothing to run."""
        return False

    def shutdown(self) -> None:
        pass


def wants_remote_prefill(params: dict | None) -> bool:
    return bool(params) and bool(params.get("do_remote_prefill"))


def wants_remote_decode(params: dict | None) -> bool:
    return bool(params) and bool(params.get("do_remote_decode"))
