"""The engine's one configuration: `EngineConfig`, frozen and sectioned, built once from `EngineArgs`
(engine/args.py) and the only configuration that crosses into the engine core, the executor and the
ranks. Nothing below engine/ reads the raw arguments. Validation raises ValueError naming the field."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# KV-cache element types by their option names (vLLM's spellings). "auto" is the model's dtype; "fp8"
# is e4m3 (the format with per-tensor k/v scales that checkpoints carry), so both names mean one dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: Any) -> Any:
    """The torch dtype of the KV cache for an option value (see KV_CACHE_DTYPES)."""
    import torch
    _require(kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the model, read from an HF config (or a GGUF's metadata)."""
    hf_config: Any
    architecture: str
    dtype: Any  # torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    quant_config: Any = None  # a layers.quantization QuantConfig, or None for float weights

    @property
    def quantization(self) -> str | None:
        """What runs, for the log and /v1/models, led by vLLM's name of the quantization: e.g.
        "fp8: FP8 per-channel weights, dynamic per-token activations (quantized at load)"."""
        q = self.quant_config
        return None if q is None else q.describe()

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # None: sized from free memory (CUDA) or cpu_kv_cache_gib (CPU)
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        resolve_kv_cache_dtype(self.kv_cache_dtype, None)  # validates the name
        _require(self.block_size in (8, 16, 32, 64, 128), f"block_size must be one of 8..128 (power of two), got {self.block_size}")
        _require(0 < self.gpu_memory_utilization <= 1, f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.num_blocks is None or self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")
        _require(self.cpu_kv_cache_gib > 0, f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")


SCHEDULING_POLICIES = ("fcfs", "priority")

# Linear-layer quantization methods by vLLM's names (layers/quantization/ implements them).
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt", "gptq", "awq")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # per-step token budget; prompts longer than it are chunked
    # fcfs: arrival order; priority: by each request's priority (lower first), then arrival.
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _require(self.policy in SCHEDULING_POLICIES,
                 f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class CompileConfig:
    enforce_eager: bool = False
    cudagraph_batch_sizes: tuple[int, ...] = field(
        # Padding to the next size wastes at most ~20% of a decode step; fewer graphs start faster.
        # No size 1: a single sequence runs padded to 2 (the same weight reads), so the compiled
        # layers never see one token and Inductor compiles no extra size-1 specialisation, unless a
        # linear method costs less at one token (decode_graph_sizes' one_row).
        default_factory=lambda: (2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                                 320, 384, 448, 512, 640, 768, 896, 1024))
    # Token counts of mixed/prefill steps captured as piecewise graphs. Above the largest, a step's
    # GPU time dwarfs the launch cost of running the compiled segments without graphs.
    # Dense enough that padding wastes at most ~12% of a step's batchful work: a 1024-token prompt
    # with its step's decode rows (~1,050 tokens) ran padded to 1,536 before, 47% of wasted GEMM rows.
    # Measured on the H100 (BENCHMARKS.md, "engine core process"): running steps above 512 tokens
    # eagerly instead wastes nothing but costs more at 24 req/s (median TPOT 19.8 vs 17.8 ms).
    piecewise_token_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1088, 1152,
                                              1280, 1408, 1536, 1792, 2048)

    def decode_graph_sizes(self, max_num_seqs: int, one_row: bool = False) -> list[int]:
        """The decode graphs' batch sizes, ascending: those up to max_num_seqs, or the smallest when
        none is (max_num_seqs 1 pads to it). one_row: the model's layers cost less at one token than
        at two (layers/linear.py cheaper_at_one_row), so one sequence gets a graph of size 1."""
        sizes = sorted(b for b in self.cudagraph_batch_sizes if b <= max_num_seqs)
        if one_row and 1 not in sizes:
            sizes.insert(0, 1)
        return sizes or sorted(self.cudagraph_batch_sizes)[:1]


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor x pipeline parallel ranks, and the hosts they span (torchrun's names)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)
    distributed_timeout_s: float = 600.0  # bound on the ranks' start-up and on any collective
    step_timeout_s: float = 300.0  # a step no rank answered within this counts as a hung rank

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    """--enable-lora: slots, the largest rank, the host cache and the adapters named at start-up."""
    max_loras: int
    max_rank: int
    max_cpu_loras: int | None
    modules: tuple[tuple[str, str], ...]  # (name, path) of --lora-modules
    allow_runtime: bool
    allowed_dir: str | None

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1 and self.max_rank >= 1,
                 f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_rank}")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's keys of --speculative-config that splitserve reads; any other key is an error at start-up.
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                     "draft_tensor_parallel_size", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config (vLLM's JSON keys). Drafts are proposed by the worker after each step
    (n-gram prompt lookup on the host, or a draft model in the same worker), verified in the next
    step as extra tokens of their sequence, and rolled back where rejected (worker/spec_decode.py)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched against the earlier context
    prompt_lookup_max: int = 3  # ngram: longest suffix tried first
    model: str | None = None    # draft_model: its checkpoint (shares the target's tokenizer)
    draft_tensor_parallel_size: int = 1
    # No drafts in a step whose running batch has at least this many sequences (speculation costs
    # more than it saves on a loaded server). None: always speculate.
    disable_by_batch_size: int | None = None
    # Filled by the config builder for draft_model: the draft's loading.resolve.ModelSource and config.
    draft_source: Any = None
    draft_hf_config: Any = None

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS,
                 f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        _require(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 32,
                 f"speculative_config: num_speculative_tokens must be an integer in [1, 32], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            _require(isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi,
                     f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
            _require(self.model is None, "speculative_config: method ngram takes no model")
        else:
            _require(bool(self.model), f"speculative_config: method {self.method} needs a model")
        _require(self.draft_tensor_parallel_size == 1,
                 f"speculative_config: draft_tensor_parallel_size must be 1, got {self.draft_tensor_parallel_size}")
        b = self.disable_by_batch_size
        _require(b is None or (isinstance(b, int) and b >= 2),
                 f"speculative_config: disable_by_batch_size must be an integer >= 2, got {b!r}")

    @classmethod
    def parse(cls, value: "str | dict") -> "SpeculativeConfig":
        """From the JSON text of --speculative-config or the dict of LLM(speculative_config=...)."""
        import json
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        _require(isinstance(value, dict), f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
        _require(not unknown, f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                              f"known: {', '.join(_SPECULATIVE_KEYS)}")
        _require("method" in value and "num_speculative_tokens" in value,
                 "speculative_config needs method and num_speculative_tokens")
        return cls(**value)

    @property
    def lookahead_slots(self) -> int:
        """KV slots a speculating request holds beyond its verified tokens: a draft model writes its
        drafts' K/V there at the end of the verify step. N-gram drafts need none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


STRUCTURED_OUTPUT_FILLS = ("process", "inline")


@dataclass(frozen=True)
class LoadConfig:
    """Where the weights and the tokenizer come from (loading.resolve.ModelSource each)."""
    source: Any
    tokenizer_source: Any = None  # None: the model's own
    random_weights: bool = False


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    compile: CompileConfig
    device: str
    attention_backend: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    load: LoadConfig | None = None  # None only in tests that hand a built model to a runner
    lora: LoRAConfig | None = None  # None: LoRA off
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    structured_outputs_fill: str = "process"  # one of STRUCTURED_OUTPUT_FILLS
    seed: int | None = None
    async_scheduling: bool | None = None  # None: on with CUDA
    # Every name clients may send (the first is the one responses show), and the request defaults of
    # the model's generation config (loading/generation_config.py).
    served_model_names: tuple[str, ...] = ()
    sampling_defaults: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.structured_outputs_fill in STRUCTURED_OUTPUT_FILLS,
                 f"structured_outputs_fill must be one of {', '.join(STRUCTURED_OUTPUT_FILLS)}, "
                 f"got {self.structured_outputs_fill!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def runs_async(self) -> bool:
        """Whether the core launches step N+1 before collecting step N (the default on CUDA)."""
        return self.device.startswith("cuda") if self.async_scheduling is None else self.async_scheduling
