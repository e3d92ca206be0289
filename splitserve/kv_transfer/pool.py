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

    total_kv_heads: int = 0  # the model's KV heads (0: num_kv_heads, one rank)

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    def mismatch(self, remote: "KVLayout") -> str | None:
        """Why the remote's blocks cannot be read into this pool, or None when they can. Another
        tensor-parallel size is fine for a one-rank reader: it reads each head from the remote rank
        that holds it (`head_sources`)."""
        keys = ["num_layers", "head_dim", "block_size", "dtype"]
        keys += ["num_kv_heads"] if self.tp_size == remote.tp_size else []
        diffs = [f"{k}: local {getattr(self, k)!r}, remote {getattr(remote, k)!r}" for k in keys
                 if getattr(self, k) != getattr(remote, k)]
        if self.tp_size != remote.tp_size:
            if self.tp_size != 1:
                diffs.append(f"tp_size: local {self.tp_size}, remote {remote.tp_size} (a reader of another "
                             f"tensor-parallel size must run on one rank)")
            elif self.model_kv_heads != remote.model_kv_heads:
                diffs.append(f"KV heads: local {self.model_kv_heads}, remote {remote.model_kv_heads}")
        return "; ".join(diffs) or None

    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


def rank_heads(total_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """The model's KV heads a tensor-parallel rank holds, in its cache's order (layers/parallel_linear.py:
    a contiguous share, or one replicated head when there are fewer heads than ranks)."""
    from splitserve.layers.parallel_linear import local_heads
    _, n, index = local_heads(tp_size * total_kv_heads, total_kv_heads, rank, tp_size)  # (query heads: any multiple)
    return list(range(index * n, (index + 1) * n)) if total_kv_heads >= tp_size else [index]


def head_sources(total_kv_heads: int, tp_size: int) -> list[tuple[int, int]]:
    """For each of the model's KV heads: (remote rank, its index in that rank's cache), the first rank
    holding it."""
    where: dict[int, tuple[int, int]] = {}
    for rank in range(tp_size):
        for i, head in enumerate(rank_heads(total_kv_heads, tp_size, rank)):
            where.setdefault(head, (rank, i))
    return [where[h] for h in range(total_kv_heads)]


def gather_heads(parts: list, total_kv_heads: int) -> "torch.Tensor":
    """Blocks read from every rank of a tensor-parallel producer (`[n, layers, 2, bs, its heads, dim]`
    each, by rank) -> the same blocks with all the model's heads, as a one-rank pool holds them."""
    sources = head_sources(total_kv_heads, len(parts))
    return torch.stack([parts[r][:, :, :, :, i] for r, i in sources], dim=4)


class LayoutOnly:
    """The engine core's view of a pool that lives in rank processes: its layout, no data (a
    tensor-parallel producer's ranks serve their blocks themselves: tcp.BlockServer)."""

    def __init__(self, layout: KVLayout):
        self.layout = layout

    def read(self, block_ids):
        raise RuntimeError("this engine's KV blocks live in its rank processes")

    def write(self, block_ids, data):
        raise RuntimeError("this engine's KV blocks live in its rank processes")


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
