"""Which engine core of a data-parallel server takes a new request.

Two signals, as the front sees them:
- prefix affinity: the chained hashes of the prompt's first full KV blocks, computed as the prefix
  cache computes them (protocol/block_hash.hash_block, with the LoRA adapter as the extra key), mapped
  to the replica that was last sent a prompt with that block. The longest known prefix wins: that
  replica most likely still holds the blocks, and a hit there skips their prefill.
- load: a replica's sequences in flight (sent and not finished; the front's own count, exact the
  moment a request is routed) plus its KV-cache usage as its core last reported it, weighted so
  that a full pool weighs as much as a full running batch.
Affinity yields when its replica is overloaded: its batch is full while another replica has a
quarter of a batch less to do. A prompt with no known prefix goes to the least loaded replica; ties
go round the replicas in turn, so sequential requests with distinct prefixes alternate.

The table is bounded (least recently used entries go) and forgets a replica that restarts (its
cache is empty). Why our own and not a router package: this runs inside the server process on
every request, over the exact block hashes the cores use; the separate `splitserve router` process
is the one that fronts many servers.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from splitserve.protocol.block_hash import hash_block


class ReplicaRouter:
    def __init__(self, num_replicas: int, block_size: int, max_running: int, max_blocks: int = 64,
                 max_entries: int = 200_000):
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.max_running = max_running
        self.max_blocks = max_blocks       # prompt blocks hashed per request (deeper ones rarely decide)
        self.max_entries = max_entries
        self._owner: OrderedDict[int, int] = OrderedDict()  # block hash -> replica last sent it
        self._next = 0                     # round-robin start for ties

    def block_hashes(self, token_ids: Sequence[int], lora_id: int | None = None) -> list[int]:
        extra = () if lora_id is None else (lora_id,)
        bs, out, parent = self.block_size, [], None
        for i in range(min(len(token_ids) // bs, self.max_blocks)):
            parent = hash_block(parent, tuple(token_ids[i * bs:(i + 1) * bs]), extra)
            out.append(parent)
        return out

    def choose(self, hashes: list[int], loads: Sequence[float | None]) -> int:
        """The replica for a request with these block hashes; `loads[i]` is None for a replica that
        takes nothing now (restarting). Raises RuntimeError when none takes requests."""
        up = [i for i, load in enumerate(loads) if load is not None]
        if not up:
            raise RuntimeError("no engine replica is serving")
        least = min(up, key=lambda i: (loads[i], (i - self._next) % self.num_replicas))
        choice = None
        for h in reversed(hashes):
            owner = self._owner.get(h)
            if owner is not None and loads[owner] is not None:
                if not self._overloaded(loads[owner], loads[least]):
                    choice = owner
                break
        if choice is None:
            choice = least
            self._next = (least + 1) % self.num_replicas
        self._record(hashes, choice)
        return choice

    def _overloaded(self, load: float, least: float) -> bool:
        return load >= self.max_running and load - least >= self.max_running / 4

    def _record(self, hashes: list[int], replica: int) -> None:
        owner = self._owner
        for h in hashes:
            owner[h] = replica
            owner.move_to_end(h)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)

    def forget(self, replica: int) -> None:
        """The replica restarted with an empty cache: its prefixes are nobody's now."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]

    def load(self, num_seqs_in_flight: int, kv_usage: float) -> float:
        return num_seqs_in_flight + kv_usage * self.max_running
