"""The worker side of a connector: whole blocks of the paged KV pool read out and written back.

The pool is one tensor per attention layer, `[num_blocks, 2 (K, V), block_size, kv_heads, head_dim]`
(worker/model_runner.py). A block moves as `[layers, 2, block_size, kv_heads, head_dim]`, so the
bytes of a block are one contiguous run per layer: what a NIXL descriptor list names on the GPU, and
what the TCP connector sends as one frame."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """What two engines must agree on before blocks move between them (checked at the handshake)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name, e.g. "float32", "bfloat16", "float8_e4m3fn"
    tp_size: int = 1

    def mismatch(self, remote: "KVLayout") -> str | None:
        """Why the remote's blocks cannot be read into this pool, or None when they can."""
        diffs = [f"{k}: local {v!r}, remote {getattr(remote, k)!r}" for k, v in asdict(self).items()
                 if k != "tp_size" and v != getattr(remote, k)]
        if self.tp_size != remote.tp_size:
            diffs.append(f"tp_size: local {self.tp_size}, remote {remote.tp_size} (head mapping across tensor-"
                         f"parallel layouts is not implemented yet)")
        return "; ".join(diffs) or None

    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVPool:
    """Reads and writes whole blocks of the paged pool. Call from the engine core's thread for writes
    (stream order with the model's steps); reads of blocks nobody writes (held for a reader) may come
    from a serving thread."""

    def __init__(self, kv_caches: list[torch.Tensor], tp_size: int = 1):
        if not kv_caches:
            raise ValueError("a KV connector needs the KV pool's tensors (none were allocated)")
        self.caches = kv_caches
        num_blocks, two, block_size, heads, dim = kv_caches[0].shape
        self.num_blocks = num_blocks
        self.layout = KVLayout(len(kv_caches), heads, dim, block_size,
                               str(kv_caches[0].dtype).removeprefix("torch."), tp_size)

    def read(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks, on the host: `[n, layers, 2, block_size, heads, dim]`."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.caches[0].device)
        return torch.stack([c.index_select(0, idx) for c in self.caches], dim=1).cpu()

    def write(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Writes `[n, layers, ...]` blocks (as `read` gives them) into the given block ids."""
        if data.shape[0] != len(block_ids) or data.shape[1] != len(self.caches):
            raise ValueError(f"{tuple(data.shape)} blocks do not fit {len(block_ids)} ids of {len(self.caches)} layers")
        device = self.caches[0].device
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        data = data.to(device, non_blocking=True)
        for layer, cache in enumerate(self.caches):
            cache.index_copy_(0, idx, data[:, layer])
