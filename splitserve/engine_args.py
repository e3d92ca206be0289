"""Every option of the engine, in one place: the CLI and the offline `LLM` keywords come from here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    device: str | None = None  # None: cuda if available, else cpu
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # None: triton on CUDA, torch_ref on CPU
    enforce_eager: bool = False
    random_weights: bool = False
    async_scheduling: bool | None = None  # overlap host and device work across steps; None: on CUDA
    served_model_name: str | None = None
